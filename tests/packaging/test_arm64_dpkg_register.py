"""tools/arm64/dpkg-register.py (the arm64 root of `make test-arm64` is unpacked by mmdebstrap
--variant=extract and recorded in the dpkg database by this script, no maintainer script run)
against dpkg itself: a package built here with dpkg-deb is unpacked by dpkg (--root, no scripts in
it) into one root and registered by the script into another; dpkg-query reads both databases and
must see the same package, status and files; dpkg --audit finds nothing wrong; the alternatives of
a postinst become the links update-alternatives would make."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from paths import ROOT

REPO = ROOT
SCRIPT = REPO / "tools" / "arm64" / "dpkg-register.py"

pytestmark = pytest.mark.skipif(
    not (shutil.which("dpkg-deb") and shutil.which("dpkg") and shutil.which("dpkg-query")),
    reason="dpkg, dpkg-deb and dpkg-query are needed (a Debian host)")


def build_deb(tmp, name, *, postinst=None, multi_arch=None, arch="all"):
    src = tmp / f"src-{name}"
    (src / "DEBIAN").mkdir(parents=True)
    (src / "usr/lib/demo").mkdir(parents=True)
    (src / "usr/lib/demo/libdemo.so.1").write_bytes(b"\x7fELF not really")
    (src / "usr/bin").mkdir(parents=True)
    (src / "usr/bin/demo-real").write_text("#!/bin/sh\n")
    (src / "etc/demo").mkdir(parents=True)
    (src / "etc/demo/demo.conf").write_text("key = value\n")
    control = [f"Package: {name}", "Version: 1.2-3", f"Architecture: {arch}", "Maintainer: t <t@example.org>",
               "Depends: libc6 (>= 2.36)"]
    if multi_arch:
        control.append(f"Multi-Arch: {multi_arch}")
    control += ["Description: demo package", " Long description line.", " .", " Second paragraph."]
    (src / "DEBIAN/control").write_text("\n".join(control) + "\n")
    (src / "DEBIAN/conffiles").write_text("/etc/demo/demo.conf\n")
    (src / "DEBIAN/shlibs").write_text("libdemo 1 demo (>= 1.2)\n")
    if postinst:
        (src / "DEBIAN/postinst").write_text(postinst)
        (src / "DEBIAN/postinst").chmod(0o755)
    deb = tmp / f"{name}.deb"
    subprocess.run(["dpkg-deb", "--root-owner-group", "-Zgzip", "--build", str(src), str(deb)],
                   check=True, capture_output=True)
    return deb


def extract(deb, root):
    subprocess.run(["dpkg-deb", "--extract", str(deb), str(root)], check=True)


def query(root, *args):
    return subprocess.run(["dpkg-query", f"--admindir={root}/var/lib/dpkg", *args],
                          check=True, capture_output=True, text=True).stdout


def register(root, *debs):
    return subprocess.run([sys.executable, str(SCRIPT), str(root), *map(str, debs)],
                          check=True, capture_output=True, text=True).stdout


def test_registered_package_reads_as_dpkg_installed_it(tmp_path):
    deb = build_deb(tmp_path, "demo")
    # dpkg's own unpack (no maintainer scripts in the package: nothing runs on this host).
    ref = tmp_path / "ref"
    (ref / "var/lib/dpkg/info").mkdir(parents=True)
    (ref / "var/lib/dpkg/updates").mkdir(parents=True)
    (ref / "var/lib/dpkg/status").write_text("")
    subprocess.run(["dpkg", f"--root={ref}", "--force-not-root", "--force-depends", "--force-script-chrootless",
                    "--log=/dev/null", "--install", str(deb)], check=True, capture_output=True)
    got = tmp_path / "got"
    extract(deb, got)
    out = register(got, deb)
    assert "1 packages recorded" in out

    fmt = "${Package} ${Version} ${Status} ${Architecture} ${Depends}\n${Conffiles}\n${Description}\n"
    assert query(got, "-W", f"-f={fmt}", "demo") == query(ref, "-W", f"-f={fmt}", "demo")
    assert sorted(query(got, "-L", "demo").split("\n")) == sorted(query(ref, "-L", "demo").split("\n"))
    assert query(got, "-S", "/usr/lib/demo/libdemo.so.1").strip() == "demo: /usr/lib/demo/libdemo.so.1"
    # dpkg-shlibdeps reads the owner's shlibs file under info/.
    assert (got / "var/lib/dpkg/info/demo.shlibs").read_text() == "libdemo 1 demo (>= 1.2)\n"
    # An edited conffile is seen as edited (the md5sum recorded is the unpacked file's).
    audit = subprocess.run(["dpkg", f"--admindir={got}/var/lib/dpkg", "--audit"], capture_output=True, text=True)
    assert audit.returncode == 0 and audit.stdout == "", audit.stdout + audit.stderr


def test_multi_arch_same_info_files_are_named_with_the_architecture(tmp_path):
    deb = build_deb(tmp_path, "demo-ma", multi_arch="same", arch="arm64")
    got = tmp_path / "got"
    extract(deb, got)
    register(got, deb)
    assert (got / "var/lib/dpkg/info/demo-ma:arm64.list").is_file()
    # (the host's dpkg-query reads an arm64 package only when arm64 is one of its architectures;
    # in the arm64 root it is the native one)
    native = subprocess.run(["dpkg", "--print-architecture"], capture_output=True, text=True).stdout.strip()
    (got / "var/lib/dpkg/arch").write_text(f"{native}\narm64\n")
    assert query(got, "-S", "/usr/bin/demo-real").startswith("demo-ma")
    assert query(got, "-W", "-f=${Package}:${Architecture} ${Status}", "demo-ma") == "demo-ma:arm64 install ok installed"


def test_postinst_alternatives_become_links_highest_priority_wins(tmp_path):
    low = build_deb(tmp_path, "alt-low", postinst=(
        "#!/bin/sh\nset -e\nif [ \"$1\" = configure ]; then\n"
        "  update-alternatives --install /usr/bin/demo demo /usr/bin/demo-real 5 \\\n"
        "      --slave /usr/bin/demo2 demo2 /usr/bin/demo-real\nfi\n"))
    high = build_deb(tmp_path, "alt-high", postinst=(
        "#!/bin/sh\nupdate-alternatives --quiet --install /usr/bin/demo demo /usr/lib/demo/libdemo.so.1 50\n"
        "update-alternatives --install /usr/bin/skipped skipped /usr/bin/$(echo x) 10\n"))
    got = tmp_path / "got"
    extract(low, got)
    extract(high, got)
    out = register(got, low, high)
    assert "1 alternatives linked" in out  # the $(...) one is left out
    assert os.readlink(got / "usr/bin/demo") == "/etc/alternatives/demo"
    assert os.readlink(got / "etc/alternatives/demo") == "/usr/lib/demo/libdemo.so.1"
    assert not (got / "usr/bin/demo2").is_symlink()  # the slave of the group that lost
    assert not (got / "usr/bin/skipped").exists()


def test_a_real_file_is_never_replaced_by_an_alternative_link(tmp_path):
    deb = build_deb(tmp_path, "alt-file", postinst=(
        "#!/bin/sh\nupdate-alternatives --install /etc/demo/demo.conf democonf /usr/bin/demo-real 5\n"))
    got = tmp_path / "got"
    extract(deb, got)
    register(got, deb)
    assert not (got / "etc/demo/demo.conf").is_symlink()
    assert (got / "etc/demo/demo.conf").read_text() == "key = value\n"


def test_a_broken_deb_is_an_error(tmp_path):
    bad = tmp_path / "bad.deb"
    bad.write_bytes(b"!<arch>\nnot a deb")
    got = tmp_path / "got"
    got.mkdir()
    r = subprocess.run([sys.executable, str(SCRIPT), str(got), str(bad)], capture_output=True, text=True)
    assert r.returncode != 0
