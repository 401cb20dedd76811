"""The suite at both ends of the supported range: `nox` (needs nox and uv; README "Run the tests").

`.ci/run` tests the pinned environment of constraints.txt. These sessions install the lowest and the newest
versions pyproject.toml allows and run the same tests, so that its bounds are ones that were tested rather than
guessed: a user who installs without constraints.txt gets the newest of everything. `pinned` checks that the
README's install command resolves on both of those Pythons (constraints.txt's newest pins need 3.11).
"""
import nox

nox.options.default_venv_backend = 'uv'
nox.options.sessions = ['pinned', 'oldest', 'newest']
# Off CI, nox skips a session whose Python it can neither find nor download, and still exits 0: a run that
# tested nothing would read as a pass.
nox.options.error_on_missing_interpreters = True


@nox.session(python='3.10')
def oldest(session):
    """The lowest Python and the lowest version of every direct dependency (torch 2.6, numpy 1.24, ...)."""
    session.install('--resolution', 'lowest-direct', '-e', '.[test]')
    session.run('python', '-m', 'pytest', '-q', *session.posargs)


@nox.session(python='3.13')
def newest(session):
    """The newest Python tested and the newest release of every dependency."""
    session.install('-e', '.[test]')
    session.run('python', '-m', 'pytest', '-q', *session.posargs)


@nox.session(python=['3.10', '3.13'])
def pinned(session):
    """constraints.txt with every extra resolves here: the README's install command works on this Python."""
    session.install('--dry-run', '-c', 'constraints.txt', '-e', '.[test,parquet,pretrained-reference]')
