import subprocess
import sys

import ktd


def test_version():
    r = subprocess.run([sys.executable, "-m", "ktd", "--version"], capture_output=True, text=True)
    assert r.returncode == 0
    assert r.stdout.strip() == f"ktd {ktd.__version__}"


def test_gguf_error_is_value_error():
    assert issubclass(ktd.GGUFError, ValueError)


def test_a_subcommand_imports_only_its_own_module():
    """`ktd run` does not import the HTTP gateway (a third of a second of its start-up); `ktd
    --help` still lists every command."""
    code = ("import sys; from ktd import cli; p = cli.build_parser('run'); "
            "print('ktd.http.serve' in sys.modules, 'run' in p.format_help()); "
            "full = cli.build_parser(); print('ktd.http.serve' in sys.modules, all(c in full.format_help() for c in cli.COMMANDS))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[0] == "False True" and out[1] == "True True"
