"""Interpreter start-up hook: `drrho_openclip.pth` (and, from Python 3.15, `drrho_openclip.start`, PEP 829) calls
`install()` in every interpreter of the environment, so it imports nothing beyond what `site` already has (sys,
os): it reads which modules the patch changes and puts a finder on `sys.meta_path` that waits for the first import
of one of them (all in open_clip_train: `import open_clip` is never touched). Only then is the import hook itself
(`drrho_openclip.openclip.import_hook`) imported and installed, and the import handed to it. Nothing here raises
at start-up; an unsupported OpenCLIP version or a patch that does not apply stops the import of open_clip_train
with a clear message instead."""
import os
import sys

PATCH_FILE = 'open_clip-3.3.0-plugin-api.patch'
MISSING_PATCH = f"{PATCH_FILE} is missing from the installation; reinstall drrho-openclip"


def patch_path():
    """The patch shipped in the wheel (drrho_openclip/patches/) or, in a source checkout, the repo's patches/;
    None if neither is there."""
    package = os.path.dirname(os.path.abspath(__file__))
    for folder in (os.path.join(package, 'patches'), os.path.join(os.path.dirname(package), 'patches')):
        if os.path.isfile(os.path.join(folder, PATCH_FILE)):
            return os.path.join(folder, PATCH_FILE)
    return None


def module_name(path):
    """'b/open_clip_train/train.py' -> 'open_clip_train.train'."""
    return path.removeprefix('b/').removesuffix('.py').replace('/', '.')


def patched_modules(path):
    """The modules the patch at `path` changes, read from its '+++ b/<file>' headers (no diff parsing)."""
    with open(path, encoding='utf-8') as patch:
        return frozenset(module_name(line[4:].split('\t')[0].strip()) for line in patch if line.startswith('+++ '))


class _DeferredHook:
    """Finds nothing itself: at the first import of a patched module it installs the import hook, which goes ahead
    of it on sys.meta_path and patches that module and the others from then on."""

    def __init__(self, modules):
        self.modules = modules

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.modules:
            return None
        from drrho_openclip.openclip.import_hook import install_import_hook
        return install_import_hook().find_spec(fullname, path, target)


def install():
    try:
        path = patch_path()
        if path is None:
            raise FileNotFoundError(MISSING_PATCH)
        if not any(isinstance(finder, _DeferredHook) for finder in sys.meta_path):
            sys.meta_path.insert(0, _DeferredHook(patched_modules(path)))
    except Exception as error:  # noqa: BLE001 - start-up must not break unrelated programs
        print(f"drrho-openclip: the OpenCLIP plugin hook could not be installed: {error}", file=sys.stderr)
