"""Collectives: the arithmetic around them (``arithmetic.py``), the fixed copy operations
(``copy_ops.py``), the schemes that sequence them (``schemes.py``) and the ``zero3::`` operations
(``ops.py``)."""
