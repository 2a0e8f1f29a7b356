"""Tools over the core, which never imports them: inspection (``inspect/``: reports, pictures,
the ``python -m zero3_compile.inspect`` command) and memory estimates (``estimate/``)."""
