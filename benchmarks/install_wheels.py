"""Install a folder of wheels on a machine with no package index, taking only what this Python lacks.

    python benchmarks/install_wheels.py WHEEL_DIR TARGET_DIR NAME [NAME ...]

Starts from NAME's requirements (no extras) and follows them through the folder's wheels: a
requirement this environment already satisfies is left alone (so the installed torch, numpy or
transformers are never shadowed), any other must be in the folder. The chosen wheels go to
TARGET_DIR with `pip install --no-deps --target` (put TARGET_DIR on PYTHONPATH). Exit status 1, and
the names, when a requirement is neither installed nor in the folder.
"""
import glob
import importlib.metadata
import os
import subprocess
import sys
import zipfile
from email.parser import Parser

try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:   # a bare environment: pip carries its own copy
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name


def read_wheels(folder: str) -> dict[str, tuple[str, str, list[str]]]:
    """name -> (path, version, Requires-Dist lines) of each wheel in folder."""
    wheels = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.whl"))):
        with zipfile.ZipFile(path) as z:
            meta_name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            meta = Parser().parsestr(z.read(meta_name).decode())
        wheels[canonicalize_name(meta["Name"])] = (path, meta["Version"], meta.get_all("Requires-Dist") or [])
    return wheels


def installed_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def wheels_to_install(wheels: dict, names: list[str]) -> tuple[list[str], list[str]]:
    """(wheel paths to install, requirements neither installed nor in the folder)."""
    chosen, missing = {}, []
    todo = [Requirement(n) for n in names]
    while todo:
        req = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = canonicalize_name(req.name)
        have = installed_version(name)
        if name in chosen or (have is not None and req.specifier.contains(have, prereleases=True)):
            continue
        if name not in wheels or not req.specifier.contains(wheels[name][1], prereleases=True):
            missing.append(f"{req} (installed: {have or 'none'}, in the folder: "
                           f"{wheels[name][1] if name in wheels else 'none'})")
            continue
        path, _, requires = wheels[name]
        chosen[name] = path
        todo.extend(Requirement(r) for r in requires)
    return sorted(chosen.values()), missing


def main():
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    folder, target, names = sys.argv[1], sys.argv[2], sys.argv[3:]
    paths, missing = wheels_to_install(read_wheels(folder), names)
    if missing:
        print("not installed and not in " + folder + ":\n  " + "\n  ".join(missing), file=sys.stderr)
        sys.exit(1)
    print("installing: " + (" ".join(os.path.basename(p).split("-")[0] for p in paths) or "nothing"))
    if paths:
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
               "--no-cache-dir", "--upgrade", "--target", target]
        subprocess.run(pip + paths, check=True)


if __name__ == "__main__":
    main()
