# Makes `import epflow` work from a source checkout (python/epflow with the built .so copied in
# by `cmake --build` with -DEPFLOW_BUILD_PYTHON=ON) when the package is not pip-installed.
import os
import sys

_PY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python")
try:
    import epflow  # noqa: F401  (installed with pip)
except ImportError:
    sys.path.insert(0, os.path.abspath(_PY))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (sm_90a); skipped without one")
    config.addinivalue_line("markers", "cpu: runs anywhere torch and the built extension are")
