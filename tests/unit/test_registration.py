"""backend="zero3" works after pip install (entry point) and after ``import zero3_compile``."""

from __future__ import annotations

from .test_errors import run_python


def test_entry_point_finds_the_backend_without_importing_the_package():
    proc = run_python(
        """
        import sys, torch
        from torch._dynamo.backends.registry import lookup_backend
        assert "zero3_compile" not in sys.modules
        backend = lookup_backend("zero3")
        print(backend.__module__, backend.__name__)
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["zero3_compile.compiler.backend", "zero3_backend"]


def test_import_registers_the_backend():
    proc = run_python(
        """
        import torch, zero3_compile
        from torch._dynamo.backends.registry import lookup_backend
        print("zero3" in torch._dynamo.list_backends(), lookup_backend("zero3") is zero3_compile.zero3_backend)
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "True"]
