"""Install pure-Python code from a wheel whose tags pip refuses here, without its deps.

NVRx 0.5.0 and 0.6.0 are ``manylinux_2_39`` wheels (this machine has glibc 2.36), NVRx
0.7.0 and megatron-core 0.17+ are cp312 wheels; the code this project runs from them is
pure Python and runs on CPython 3.11. So pip is told the platform and Python the wheel
names and installs into the running interpreter's site-packages. Their light
dependencies are pinned in ``nvrx-deps.txt`` (tox installs them).

    python requirements/install_wheel.py nvidia-resiliency-ext==0.6.0 [megatron-core==0.17.1]
"""

import subprocess
import sys
import sysconfig

WHEEL_TAGS = {  # requirement -> (platform, python version) named in the wheel on PyPI
    "nvidia-resiliency-ext==0.4.1": ("manylinux_2_31_x86_64", None),
    "nvidia-resiliency-ext==0.5.0": ("manylinux_2_39_x86_64", None),
    "nvidia-resiliency-ext==0.6.0": ("manylinux_2_39_x86_64", None),
    "nvidia-resiliency-ext==0.7.0": ("manylinux_2_39_x86_64", "3.12"),
    "megatron-core==0.17.1": ("manylinux_2_28_x86_64", "3.12"),
}


def main(requirements):
    for requirement in requirements:
        platform, python = WHEEL_TAGS[requirement]
        command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--upgrade",
                   "--ignore-requires-python", "--only-binary=:all:", "--platform", platform,
                   "--target", sysconfig.get_paths()["purelib"], requirement]
        if python:
            command[-1:-1] = ["--python-version", python]
        subprocess.check_call(command)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
