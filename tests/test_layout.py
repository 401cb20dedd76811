"""The package's layering, read from its imports: the losses need only torch, and one package imports OpenCLIP."""
import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / 'drrho_openclip'
OPENCLIP = {'open_clip', 'open_clip_train'}


def imported_packages(path: Path) -> set:
    """The top-level names of the absolute imports of a module, wherever they sit (lazy imports included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split('.')[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.split('.')[0])
    return names


@pytest.mark.parametrize('module', sorted((PACKAGE / 'losses').glob('*.py')), ids=lambda p: p.name)
def test_the_losses_need_only_torch(module):
    foreign = imported_packages(module) - set(sys.stdlib_module_names) - {'torch'}
    assert not foreign, f"{module.name} imports {sorted(foreign)}"


def test_only_the_boundary_package_imports_openclip():
    importers = {path.relative_to(PACKAGE).as_posix() for path in PACKAGE.rglob('*.py')
                 if imported_packages(path) & OPENCLIP}
    assert 'openclip/model.py' in importers  # the check reads what it should
    assert {name for name in importers if not name.startswith('openclip/')} == set()
