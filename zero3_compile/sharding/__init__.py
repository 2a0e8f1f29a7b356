"""What a sharded parameter is: its geometry (``spec.py``), the data-parallel mesh and its roles
(``mesh.py``), the mixed-precision policy it is gathered and reduced in (``policy.py``), and the
per-parameter and per-module state (``state.py``)."""
