import subprocess
import sys

import ktd


def test_version():
    r = subprocess.run([sys.executable, "-m", "ktd", "--version"], capture_output=True, text=True)
    assert r.returncode == 0
    assert r.stdout.strip() == f"ktd {ktd.__version__}"


def test_gguf_error_is_value_error():
    assert issubclass(ktd.GGUFError, ValueError)
