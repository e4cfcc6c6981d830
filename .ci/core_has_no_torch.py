"""Exit 1 (with one error line) when torch is importable in this environment: the core
install must not pull it in through any dependency."""
import importlib.util
import sys

if importlib.util.find_spec("torch") is not None:
    print(f"error: torch is importable in the core environment {sys.prefix}: a core dependency "
          "pulls it in", file=sys.stderr)
    sys.exit(1)
