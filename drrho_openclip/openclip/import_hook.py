"""The import hook that applies `patches/open_clip-3.3.0-plugin-api.patch` to OpenCLIP's training package.

The patch adds a small plugin API to open_clip_train (see `drrho_openclip.openclip` for the hooks it calls).
Installed OpenCLIP files are never edited: when Python imports one of the modules the patch names, the hook applies
that file's hunks to the source in memory, the way pytest rewrites asserts. The patch is the single source of
truth (of the hunks and of which modules are patched), and it applies exactly or the import fails with a clear
message. The interpreter start-up hook (`drrho_openclip._bootstrap`) installs this one at the first import of a
patched module.
"""
import importlib.abc
import importlib.machinery
import linecache
import sys
import threading
from pathlib import Path

from .. import _bootstrap

SUPPORTED_OPENCLIP = '3.3.0'  # the patch's context lines are this release's, line for line
PATCH_FILE = _bootstrap.PATCH_FILE


class PluginActivationError(ImportError):
    pass


def patch_path() -> Path:
    """The patch shipped in the wheel (drrho_openclip/patches/) or, in a source checkout, the repo's patches/."""
    path = _bootstrap.patch_path()
    if path is None:
        raise PluginActivationError(f"drrho-openclip: {_bootstrap.MISSING_PATCH}")
    return Path(path)


def patches_by_module() -> dict:
    """{'open_clip_train.train': <whatthepatch diff>, ...} for every file the patch touches."""
    import whatthepatch
    diffs = whatthepatch.parse_patch(patch_path().read_text())
    return {_bootstrap.module_name(diff.header.new_path): diff for diff in diffs}


def check_openclip_version():
    import importlib.metadata  # here, not at start-up: it costs more than the whole hook
    try:
        version = importlib.metadata.version('open_clip_torch')
    except importlib.metadata.PackageNotFoundError:
        raise PluginActivationError("drrho-openclip: open_clip_torch is not installed") from None
    if version.split('+')[0] != SUPPORTED_OPENCLIP:  # a local build of it (3.3.0+local) is its source
        raise PluginActivationError(
            f"drrho-openclip supports open_clip_torch {SUPPORTED_OPENCLIP}, found {version}: "
            f"install open_clip_torch=={SUPPORTED_OPENCLIP} or uninstall drrho-openclip")
    return version


def patched_source(module: str, source: str, diff) -> str:
    import importlib.metadata
    import whatthepatch
    try:
        lines = whatthepatch.apply_diff(diff, source)
    except whatthepatch.exceptions.HunkApplyException as e:
        raise PluginActivationError(
            f"drrho-openclip: {PATCH_FILE} does not apply to {module} "
            f"(open_clip_torch {importlib.metadata.version('open_clip_torch')}): {e}") from e
    return '\n'.join(lines) + '\n'


class _PatchedSourceLoader(importlib.machinery.SourceFileLoader):
    def __init__(self, fullname, path, diff):
        super().__init__(fullname, path)
        self.diff = diff

    def exec_module(self, module):
        module.__drrho_patched__ = True
        super().exec_module(module)

    def get_source(self, fullname=None):
        return patched_source(self.name, self.get_data(self.path).decode('utf-8'), self.diff)

    def get_code(self, fullname):
        # Compiled fresh every time: a cached .pyc would be the unpatched file. The code's file name marks it as
        # patched, so tracebacks never quote lines of the file on disk; linecache finds the patched text through
        # get_source (the module's __loader__) whenever its cache is cleared.
        source = self.get_source()
        filename = f"{self.path} (patched by drrho-openclip)"
        linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
        return compile(source, filename, 'exec', dont_inherit=True)


class _PatchingFinder(importlib.abc.MetaPathFinder):
    def __init__(self, modules):
        self.modules = frozenset(modules)
        self.diffs = None  # parsed at the first import of a patched module

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.modules:
            return None
        if self.diffs is None:
            check_openclip_version()
            self.diffs = patches_by_module()
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or not isinstance(spec.loader, importlib.machinery.SourceFileLoader):
            raise PluginActivationError(f"drrho-openclip: cannot find the source of {fullname} to patch")
        spec.loader = _PatchedSourceLoader(fullname, spec.origin, self.diffs[fullname])
        return spec


_installing = threading.Lock()  # the first import of open_clip_train installs the hook, in whichever thread


def install_import_hook() -> _PatchingFinder:
    """Idempotent; returns the hook. Fails if a module to patch was already imported unpatched (the hook came too
    late), and is then not installed: the modules imported later would be patched, beside unpatched ones."""
    with _installing:
        for finder in sys.meta_path:
            if isinstance(finder, _PatchingFinder):
                return finder
        modules = _bootstrap.patched_modules(patch_path())
        too_late = [m for m in modules if m in sys.modules and not hasattr(sys.modules[m], '__drrho_patched__')]
        if too_late:
            raise PluginActivationError(
                f"drrho-openclip: {', '.join(sorted(too_late))} was imported before the plugin hook: call "
                f"drrho_openclip.openclip.install_import_hook() before importing open_clip_train, or run `python -m "
                f"drrho_openclip.train`")
        finder = _PatchingFinder(modules)
        sys.meta_path.insert(0, finder)
        return finder


def openclip_main(argv) -> int:
    """OpenCLIP's training entry point (`open_clip_train.main.main`) with the hook installed first. OpenCLIP finds
    the plugin by its entry point: a checkout that is on the path but not installed has none, and would train plain
    CLIP with `--loss` read as OpenCLIP's `--loss-dist-impl`."""
    import importlib.metadata
    if not importlib.metadata.entry_points(group='open_clip_train.plugins', name='drrho'):
        raise PluginActivationError("drrho-openclip: its entry point (open_clip_train.plugins: drrho) is not "
                                    "registered; install the package (`pip install -e .` for a checkout)")
    install_import_hook()
    from open_clip_train.main import main
    return main(argv)
