"""The `starling` command of the wheel: runs the starling binary the wheel bundles
(``starling/bin/starling``, put there by scripts/build-python.sh) with the same arguments."""
import os
import sys


def binary():
    """The bundled binary's path."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "bin", "starling")


def main():
    exe = binary()
    if not os.access(exe, os.X_OK):
        sys.stderr.write(f"starling: the command's binary is missing from this installation ({exe}); "
                         "reinstall the wheel built by scripts/build-python.sh\n")
        return 255
    os.execv(exe, ["starling", *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())
