"""Install pure-Python code from a wheel whose tags pip refuses here, without its deps.

NVRx 0.5.0 and 0.6.0 are ``manylinux_2_39`` wheels (this machine has glibc 2.36), NVRx
0.7.0 and megatron-core 0.17+ are cp312 wheels; the code this project runs from them is
pure Python and runs on CPython 3.11. So pip is told the platform and Python the wheel
names and installs into the running interpreter's site-packages. Their light
dependencies are pinned in ``nvrx-deps.txt`` (tox installs them).

    python requirements/install_wheel.py [--python PATH] nvidia-resiliency-ext==0.6.0 [megatron-core==0.17.1 skyrl==0.4.0]
    python requirements/install_wheel.py nvidia-resiliency-ext==0.6.0 megatron-core==0.19.2 megatron-bridge==0.6.2

``--python PATH`` installs into that interpreter's site-packages (a venv without pip). The
dist-info of any other version of the same project is removed first, so that one version
stays installed. Each wheel is unpacked into a scratch folder first and moved in from there, so
that wheels sharing a namespace package (megatron-core's ``megatron/core`` and
megatron-bridge's ``megatron/bridge``) do not replace each other's folder.
"""

import glob
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile

WHEEL_TAGS = {  # requirement -> (platform, python version) named in the wheel on PyPI
    "nvidia-resiliency-ext==0.4.1": ("manylinux_2_31_x86_64", None),
    "nvidia-resiliency-ext==0.5.0": ("manylinux_2_39_x86_64", None),
    "nvidia-resiliency-ext==0.6.0": ("manylinux_2_39_x86_64", None),
    "nvidia-resiliency-ext==0.7.0": ("manylinux_2_39_x86_64", "3.12"),
    "megatron-core==0.17.1": ("manylinux_2_28_x86_64", "3.12"),
    "megatron-core==0.19.2": ("manylinux_2_28_x86_64", "3.12"),
    "megatron-bridge==0.6.2": ("any", "3.12"),  # py3-none-any, but Requires-Python >=3.12
    "skyrl==0.4.0": ("any", "3.12"),  # py3-none-any, but Requires-Python >=3.12
}


def move_in(source, target):
    """Move everything under ``source`` to ``target``, replacing what is there, except that a
    folder with no ``__init__.py`` on both sides (a namespace package, or ``bin``) is merged."""
    for name in os.listdir(source):
        src, dst = os.path.join(source, name), os.path.join(target, name)
        if (os.path.isdir(src) and os.path.isdir(dst) and not os.path.islink(dst)
                and not os.path.exists(os.path.join(src, "__init__.py"))):
            move_in(src, dst)
            continue
        if os.path.isdir(dst) and not os.path.islink(dst):
            shutil.rmtree(dst)
        elif os.path.lexists(dst):
            os.unlink(dst)
        shutil.move(src, dst)


def main(args):
    purelib = sysconfig.get_paths()["purelib"]
    if args[:1] == ["--python"] and len(args) > 1:
        purelib = subprocess.check_output(
            [args[1], "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            text=True).strip()
        args = args[2:]
    unknown = [r for r in args if r not in WHEEL_TAGS]
    if unknown:
        print(f"install_wheel.py: no wheel known for {', '.join(unknown)}; known: "
              f"{', '.join(WHEEL_TAGS)}", file=sys.stderr)
        return 2
    for requirement in args:
        platform, python = WHEEL_TAGS[requirement]
        project = requirement.split("==")[0].replace("-", "_")
        for info in glob.glob(os.path.join(purelib, f"{project}-*.dist-info")):
            shutil.rmtree(info)  # another version's metadata would be reported instead
        with tempfile.TemporaryDirectory(dir=purelib) as scratch:
            command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-compile",
                       "--no-deps", "--ignore-requires-python", "--only-binary=:all:",
                       "--platform", platform, "--target", scratch, requirement]
            if python:
                command[-1:-1] = ["--python-version", python]
            subprocess.check_call(command)
            move_in(scratch, purelib)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
