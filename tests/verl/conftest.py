"""The verl tests run in their own environment (verl pins an older transformers): ``.ci/run``'s
verl stage. Elsewhere they are not collected (not skipped: they are another stage's)."""

import importlib.util

if importlib.util.find_spec("verl") is None:
    collect_ignore_glob = ["test_*.py"]
