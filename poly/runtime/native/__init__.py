"""Home of the compiled C extension poly.runtime.native.ckernels (built from csrc/ at install).

A package of its own so that importing the extension does not import poly.runtime (which would
close an import circle through poly.runtime.ckernels)."""
