"""The ``zero3`` backend: dynamo graph -> AOTAutograd -> partition -> scheduled graphs -> codegen
(``backend.py``), the passes (``passes/``) in order (``pipeline.py``), the memory budget
(``planner.py``, ``memory.py``), what a pass may read (``context.py``, ``options.py``), facts about
nodes (``graph_facts.py``, ``markers.py``, ``buckets.py``) and the recorded graphs
(``recording.py``)."""
