"""Install pure-Python code from a wheel whose tags pip refuses here, without its deps.

NVRx 0.5.0 and 0.6.0 are ``manylinux_2_39`` wheels (this machine has glibc 2.36), NVRx
0.7.0 and megatron-core 0.17+ are cp312 wheels; the code this project runs from them is
pure Python and runs on CPython 3.11. So pip is told the platform and Python the wheel
names and installs into the running interpreter's site-packages. Their light
dependencies are pinned in ``nvrx-deps.txt`` (tox installs them).

    python requirements/install_wheel.py [--python PATH] nvidia-resiliency-ext==0.6.0 [megatron-core==0.17.1 skyrl==0.4.0]

``--python PATH`` installs into that interpreter's site-packages (a venv without pip). The
dist-info of any other version of the same project is removed first, so that one version
stays installed.
"""

import glob
import os
import shutil
import subprocess
import sys
import sysconfig

WHEEL_TAGS = {  # requirement -> (platform, python version) named in the wheel on PyPI
    "nvidia-resiliency-ext==0.4.1": ("manylinux_2_31_x86_64", None),
    "nvidia-resiliency-ext==0.5.0": ("manylinux_2_39_x86_64", None),
    "nvidia-resiliency-ext==0.6.0": ("manylinux_2_39_x86_64", None),
    "nvidia-resiliency-ext==0.7.0": ("manylinux_2_39_x86_64", "3.12"),
    "megatron-core==0.17.1": ("manylinux_2_28_x86_64", "3.12"),
    "skyrl==0.4.0": ("any", "3.12"),  # py3-none-any, but Requires-Python >=3.12
}


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
        command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-compile", "--no-deps",
                   "--upgrade", "--ignore-requires-python", "--only-binary=:all:",
                   "--platform", platform, "--target", purelib, requirement]
        if python:
            command[-1:-1] = ["--python-version", python]
        subprocess.check_call(command)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
