"""Install one NVRx release into the running interpreter's site-packages, without its deps.

NVRx 0.5.0 and 0.6.0 are ``manylinux_2_39`` wheels and 0.7.0 is cp312-only; their
checkpointing code is pure Python and runs on this Debian 12 (glibc 2.36) CPython 3.11,
so pip is told the platform and Python the wheel names. The light dependencies the
checkpointing code imports are pinned in ``nvrx-deps.txt`` (tox installs them).

    python requirements/install_nvrx.py 0.6.0
"""

import subprocess
import sys
import sysconfig

WHEEL_TAGS = {  # version -> (platform, python version) named in the wheel on PyPI
    "0.4.1": ("manylinux_2_31_x86_64", None),
    "0.5.0": ("manylinux_2_39_x86_64", None),
    "0.6.0": ("manylinux_2_39_x86_64", None),
    "0.7.0": ("manylinux_2_39_x86_64", "3.12"),
}


def main(version: str) -> int:
    platform, python = WHEEL_TAGS[version]
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--upgrade",
               "--only-binary=:all:", "--platform", platform,
               "--target", sysconfig.get_paths()["purelib"],
               f"nvidia-resiliency-ext=={version}"]
    if python:
        command[-1:-1] = ["--python-version", python]
    return subprocess.call(command)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
