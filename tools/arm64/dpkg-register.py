#!/usr/bin/env python3
"""Record packages already unpacked into a root (mmdebstrap --variant=extract) in that root's dpkg
database, as if dpkg had installed them, without running any maintainer script.

    dpkg-register.py ROOT DEB...

Used by tools/arm64/make-root.sh: unpacking and configuring an arm64 root's packages under
qemu-user costs minutes of emulated CPU (py3compile, c_rehash, perl), while the host's dpkg-deb
reads the same .debs natively. What the root is used for needs the database itself, not the
scripts' effects: dpkg-shlibdeps (dh_shlibdeps of `make deb ARCH=arm64`) asks `dpkg-query -S` which
package owns each library and reads the owners' shlibs/symbols files; make-root.sh checks the
installed packages with dpkg-query. The few effects of maintainer scripts that matter there are
made by make-root.sh by hand (see it).

For each .deb (read with the host's dpkg-deb, which handles any architecture):
  status             its control stanza with "Status: install ok installed" (and its Conffiles
                     with their md5sums as unpacked)
  info/PKG.list      every path of its data archive ("/." first, as dpkg writes it)
  info/PKG.{md5sums,shlibs,symbols,triggers,conffiles}   from its control archive
where PKG is "name:arch" for Multi-Arch: same packages (dpkg's naming), "name" otherwise.
and the links of the update-alternatives --install calls in their postinsts (libblas.so.3 for
numpy, awk, which, cpp, ...). Maintainer scripts are not copied: dpkg never runs them for these packages (nobody removes or
upgrades packages in this root).
"""
import hashlib
import os
import re
import subprocess
import sys
import tarfile

KEEP_CONTROL = ("md5sums", "shlibs", "symbols", "triggers", "conffiles")
# --unpacked: the maintainer scripts too, for `dpkg --configure -a` to run.
SCRIPTS = ("preinst", "postinst", "prerm", "postrm", "config", "templates")
ALTERNATIVES = re.compile(r"update-alternatives\s+(?:--quiet\s+)?--install\s+([^;&|\n]*)")


def alternatives(postinst):
    """The update-alternatives --install groups of a postinst: (priority, name, [(link, name, path)]).
    Only literal arguments (a line with a shell expansion is left out)."""
    text = postinst.replace("\\\n", " ")
    groups = []
    for m in ALTERNATIVES.finditer(text):
        words = m.group(1).split()
        if any(c in m.group(1) for c in "$`") or len(words) < 4 or not words[3].isdigit():
            continue
        links = [(words[0], words[1], words[2])]
        rest = words[4:]
        while len(rest) >= 4 and rest[0] == "--slave":
            links.append(tuple(rest[1:4]))
            rest = rest[4:]
        groups.append((int(words[3]), words[1], links))
    return groups


def deb_tar(deb, what):
    """The data (--fsys-tarfile) or control (--ctrl-tarfile) archive of a .deb, as a stream."""
    proc = subprocess.Popen(["dpkg-deb", what, deb], stdout=subprocess.PIPE)
    return proc, tarfile.open(fileobj=proc.stdout, mode="r|*")


def parse_control(text):
    fields = []
    for line in text.splitlines():
        if line[:1] in (" ", "\t") and fields:
            fields[-1][1] += "\n" + line
        elif line:
            name, _, value = line.partition(":")
            fields.append([name, value.strip()])
    return fields


def register(root, deb, unpacked=False):
    control = subprocess.run(["dpkg-deb", "-f", deb], check=True, capture_output=True, text=True).stdout
    fields = parse_control(control)
    get = {k.lower(): v for k, v in fields}
    name, arch = get["package"], get.get("architecture", "all")
    pkg = f"{name}:{arch}" if get.get("multi-arch") == "same" else name
    info = os.path.join(root, "var/lib/dpkg/info")

    proc, tar = deb_tar(deb, "--fsys-tarfile")
    paths, regular = [], []
    for member in tar:
        p = member.name
        if p.startswith("./"):
            p = p[1:]
        p = "/" + p.strip("/") if p.strip("/.") else "/."
        paths.append(p)
        if member.isfile():
            regular.append(p)
    tar.close()
    if proc.wait() != 0:
        raise SystemExit(f"dpkg-register: dpkg-deb --fsys-tarfile {deb} failed")
    with open(os.path.join(info, pkg + ".list"), "w") as f:
        f.write("\n".join(["/."] + [p for p in paths if p != "/."]) + "\n")

    conffiles, alts = [], []
    proc, tar = deb_tar(deb, "--ctrl-tarfile")
    for member in tar:
        base = os.path.basename(member.name)
        if member.isfile() and base == "postinst" and not unpacked:
            alts = alternatives(tar.extractfile(member).read().decode(errors="replace"))
            continue
        if member.isfile() and (base in KEEP_CONTROL or (unpacked and base in SCRIPTS)):
            data = tar.extractfile(member).read()
            with open(os.path.join(info, f"{pkg}.{base}"), "wb") as f:
                f.write(data)
            os.chmod(os.path.join(info, f"{pkg}.{base}"), member.mode & 0o755)
            if base == "conffiles":
                conffiles = [c.strip() for c in data.decode().splitlines() if c.strip().startswith("/")]
    tar.close()
    if proc.wait() != 0:
        raise SystemExit(f"dpkg-register: dpkg-deb --ctrl-tarfile {deb} failed")

    # dpkg computes the md5sums of a package that ships none when it unpacks it (dpkg --audit
    # reports a package without them): the same here, from the files as unpacked.
    if not os.path.exists(os.path.join(info, pkg + ".md5sums")):
        with open(os.path.join(info, pkg + ".md5sums"), "w") as f:
            for p in regular:
                if p in conffiles:
                    continue
                try:
                    with open(os.path.join(root, p.lstrip("/")), "rb") as g:
                        f.write(f"{hashlib.md5(g.read()).hexdigest()}  {p.lstrip('/')}\n")
                except FileNotFoundError:  # left out by a path-exclude
                    pass

    out = []
    for k, v in fields:
        out.append(f"{k}:{v}" if v.startswith("\n") else f"{k}: {v}")
        if k.lower() == "package":
            out.append("Status: install ok " + ("unpacked" if unpacked else "installed"))
    if conffiles:
        lines = []
        for c in conffiles:
            try:
                with open(os.path.join(root, c.lstrip("/")), "rb") as f:
                    md5 = hashlib.md5(f.read()).hexdigest()
            except FileNotFoundError:
                md5 = "newconffile"
            lines.append(f" {c} {md5}")
        out.append("Conffiles:\n" + "\n".join(lines))
    return name, "\n".join(out) + "\n", alts


def main(argv):
    if len(argv) < 3:
        print("usage: dpkg-register.py ROOT DEB...", file=sys.stderr)
        return 2
    unpacked = "--unpacked" in argv[1:3]
    argv = [a for a in argv if a != "--unpacked"]
    root, debs = argv[1], argv[2:]
    admin = os.path.join(root, "var/lib/dpkg")
    for d in ("info", "updates", "triggers", "alternatives"):
        os.makedirs(os.path.join(admin, d), exist_ok=True)
    stanzas = sorted(register(root, deb, unpacked) for deb in debs)
    with open(os.path.join(admin, "status"), "w") as f:
        f.write("\n".join(s for _, s, _ in stanzas))
    # The alternatives the postinsts would have set up (e.g. libblas.so.3, which numpy links to;
    # awk): the highest priority of each name whose target is in the root, as update-alternatives'
    # automatic mode chooses.
    best = {}
    for _, _, alts in stanzas:
        for prio, name, links in alts:
            if os.path.lexists(os.path.join(root, links[0][2].lstrip("/"))) and prio >= best.get(name, (-1,))[0]:
                best[name] = (prio, links)
    os.makedirs(os.path.join(root, "etc/alternatives"), exist_ok=True)
    for prio, links in best.values():
        for link, name, path in links:
            if not os.path.lexists(os.path.join(root, path.lstrip("/"))):
                continue
            for at, to in ((f"/etc/alternatives/{name}", path), (link, f"/etc/alternatives/{name}")):
                at = os.path.join(root, at.lstrip("/"))
                if os.path.lexists(at) and not os.path.islink(at):
                    continue  # a real file of a package: never replaced
                if os.path.lexists(at):
                    os.unlink(at)
                os.makedirs(os.path.dirname(at), exist_ok=True)
                os.symlink(to, at)
    # The multiarch database layout (info/PKG:ARCH.* for Multi-Arch: same): without this file
    # dpkg reads info/ in the old layout and finds no file list for libc6:arm64 and the like.
    with open(os.path.join(admin, "info", "format"), "w") as f:
        f.write("1\n")
    for empty in ("available", "diversions", "statoverride"):
        open(os.path.join(admin, empty), "a").close()
    print(f"dpkg-register: {len(stanzas)} packages recorded in {admin}/status, "
          f"{len(best)} alternatives linked")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
