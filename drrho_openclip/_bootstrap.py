"""Interpreter start-up hook: `drrho_openclip.pth` (and, from Python 3.15, `drrho_openclip.start`, PEP 829) calls
`install()`, which adds the import hook that patches open_clip_train when it is imported. Cheap (no torch import),
and it never raises at start-up; an unsupported OpenCLIP version or a patch that does not apply stops the import of
open_clip_train with a clear message instead."""


def install():
    try:
        from drrho_openclip.openclip import install_import_hook
        install_import_hook()
    except Exception as error:  # noqa: BLE001 - start-up must not break unrelated programs
        import sys
        print(f"drrho-openclip: the OpenCLIP plugin hook could not be installed: {error}", file=sys.stderr)
