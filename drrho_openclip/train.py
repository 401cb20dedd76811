"""`python -m drrho_openclip.train ARGS` — OpenCLIP's `open_clip_train.main` with the plugin hook installed explicitly
(equivalent to `python -m open_clip_train.main ARGS` where the start-up hook is active)."""
import sys

from drrho_openclip.openclip import openclip_main


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    return openclip_main(argv[1:] if argv[:1] == ['--'] else argv)


if __name__ == '__main__':
    sys.exit(main())
