"""Small wheels and source distributions the dependency tests install, written here:
the tests run with no network, from a find-links directory of these."""

from __future__ import annotations

import base64
import hashlib
import io
import sys
import tarfile
import zipfile
from pathlib import Path

TESTPKG = "polyserve-testpkg"  # no index has it, so only a find-links directory can


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def wheel(
    directory: Path,
    dist: str,
    version: str,
    files: dict[str, str | bytes],
    requires: tuple[str, ...] = (),
    tag: str = "py3-none-any",
) -> Path:
    """A wheel of `files` with its METADATA, WHEEL and RECORD, as a build backend writes."""
    norm = dist.replace("-", "_")
    info = f"{norm}-{version}.dist-info"
    meta = f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n"
    meta += "".join(f"Requires-Dist: {r}\n" for r in requires)
    content = {n: c.encode() if isinstance(c, str) else c for n, c in files.items()}
    content[f"{info}/METADATA"] = meta.encode()
    content[f"{info}/WHEEL"] = (
        f"Wheel-Version: 1.0\nGenerator: polyserve-tests\nRoot-Is-Purelib: true\nTag: {tag}\n"
    ).encode()
    record = [_record_line(n, c) for n, c in content.items()] + [f"{info}/RECORD,,"]
    content[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    path = directory / f"{norm}-{version}-{tag}.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, data in content.items():
            z.writestr(name, data)
    return path


def make_testpkg(directory: Path, version: str) -> Path:
    """polyserve-testpkg `version`: a package whose modules import each other by their
    real names, and which reads its own version through importlib.metadata."""
    init = (
        f"__version__ = {version!r}\n"
        "from polyserve_testpkg import sub\n"  # absolute: must find this version's sub
        "import importlib.metadata\n"
        "metadata_version = importlib.metadata.version('polyserve-testpkg')\n"
        "calls = []\n"
    )
    sub = f"WHO = 'sub of {version}'\n"
    return wheel(
        directory,
        TESTPKG,
        version,
        {"polyserve_testpkg/__init__.py": init, "polyserve_testpkg/sub.py": sub},
    )


def failing_sdist(directory: Path, dist: str = "polyserve-badbuild", version: str = "1.0") -> Path:
    """A source distribution whose in-tree build backend fails: a build, with no network
    and no build requirements, that cannot succeed."""
    norm = dist.replace("-", "_")
    base = f"{norm}-{version}"
    files = {
        f"{base}/PKG-INFO": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n",
        f"{base}/pyproject.toml": (
            "[build-system]\nrequires = []\nbuild-backend = 'backend'\nbackend-path = ['.']\n"
        ),
        f"{base}/backend.py": (
            "def _fail(*args, **kwargs):\n"
            "    raise RuntimeError('this package cannot be built (on purpose)')\n"
            "get_requires_for_build_wheel = prepare_metadata_for_build_wheel = _fail\n"
            "build_wheel = build_sdist = _fail\n"
        ),
    }
    path = directory / f"{base}.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def wheelhouse(directory: Path) -> Path:
    """The find-links directory the dependency tests install from."""
    directory.mkdir(parents=True, exist_ok=True)
    make_testpkg(directory, "1.0")
    make_testpkg(directory, "2.0")
    # Depends on a numpy no host has (before 1.0): a conflict found only after resolution.
    wheel(directory, "polyserve-oldnumpy", "1.0", {"polyserve_oldnumpy.py": ""}, ("numpy<1",))
    # Ships a .pth file, which would run at every interpreter start.
    wheel(
        directory,
        "polyserve-pth",
        "1.0",
        {"polyserve_pth.pth": "import os\n", "polyserve_pth_mod.py": ""},
    )
    # Under names of their own, they ship a module the host imports: its starlette (a
    # package), its numpy (a module file).
    wheel(
        directory,
        "polyserve-shadow",
        "1.0",
        {"starlette/__init__.py": "FORGED = True\n", "polyserve_shadow.py": ""},
    )
    wheel(directory, "polyserve-numpy-module", "1.0", {"numpy.py": "FORGED = True\n"})
    # Fine by itself; its extra `old` wants a numpy no host has, and so does the package
    # that asks for that extra.
    wheel(
        directory,
        "polyserve-extras",
        "1.0",
        {"polyserve_extras.py": ""},
        ('numpy<1; extra == "old"',),
    )
    wheel(
        directory,
        "polyserve-wants-old",
        "1.0",
        {"polyserve_wants_old.py": ""},
        ("polyserve-extras[old]",),
    )
    # Breaks at import: validation must say so at deploy.
    wheel(directory, "polyserve-broken", "1.0", {"polyserve_broken.py": "raise ImportError('x')\n"})
    failing_sdist(directory)
    return directory


# A single-phase C extension module: PyInit counts its calls in a static, which a second
# initialisation of the same loaded library would show.
_COUNTING_C = """
#include <Python.h>
static int inits = 0;
static PyObject *count(PyObject *self, PyObject *args) { return PyLong_FromLong(inits); }
static PyMethodDef methods[] = {{"inits", count, METH_NOARGS, NULL}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef def = {PyModuleDef_HEAD_INIT, "_core", NULL, -1, methods};
PyMODINIT_FUNC PyInit__core(void) {
    %(import)s
    inits++;
    return PyModule_Create(&def);
}
"""
# What a Cython module's `from pkg import helper` does: an import by the real name, from C.
_IMPORT_BY_NAME = (
    'PyObject *m = PyImport_ImportModule("%s.helper"); if (m == NULL) return NULL; Py_DECREF(m);'
)


def compiled_wheel(directory: Path, dist: str, imports_itself: bool = False) -> Path | None:
    """A wheel whose package holds a C extension `_core` built here with the system's C
    compiler, or None where there is none (or no Python headers)."""
    import shutil
    import subprocess
    import sysconfig
    import tempfile

    include = Path(sysconfig.get_paths()["include"])
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None or not (include / "Python.h").is_file():
        return None
    package = dist.replace("-", "_")
    source = _COUNTING_C % {"import": _IMPORT_BY_NAME % package if imports_itself else ""}
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    with tempfile.TemporaryDirectory() as tmp:
        c_file = Path(tmp) / "core.c"
        c_file.write_text(source)
        so = Path(tmp) / f"_core{suffix}"
        subprocess.run(
            [compiler, "-shared", "-fPIC", "-O0", f"-I{include}", str(c_file), "-o", str(so)],
            check=True,
            capture_output=True,
        )
        files: dict[str, str | bytes] = {
            f"{package}/__init__.py": "from . import _core\n",
            f"{package}/helper.py": "",
            f"{package}/_core{suffix}": so.read_bytes(),
        }
    abi = sys.implementation.cache_tag.replace("cpython-", "cp")
    platform = sysconfig.get_platform().replace("-", "_").replace(".", "_")
    return wheel(directory, dist, "1.0", files, tag=f"{abi}-{abi}-{platform}")
