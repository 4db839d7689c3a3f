"""Sessions: `nox -s demo`, `nox -s tests`, `nox -s stress`, `nox -s bench`, `nox -s docs`,
`nox -s gpu`.

Every session installs through pip with constraints.txt, which pins torch to the CPU
wheel on the project's machines (uv would not find it).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["tests"]

CONSTRAINTS = ("-c", "constraints.txt")


def _install(session: nox.Session, extras: str = "") -> None:
    session.install("--upgrade", "pip")
    session.install(*CONSTRAINTS, "-e", f".{extras}")


def _azurite(session: nox.Session) -> None:
    """Azure's emulator for the tests, from npm, where node is (else those tests skip)."""
    if shutil.which("npm") is None:
        session.log("npm not found: the Azure tests will be skipped")
        return
    if not Path(".nox/node/node_modules/.bin/azurite-blob").exists():
        install = ["npm", "install", "--prefix", ".nox/node", "--no-save", "--no-audit", "--no-fund"]
        session.run(*install, "azurite@3.35.0", external=True)


@nox.session
def tests(session: nox.Session) -> None:
    """Test suite, then ruff and mypy --strict on src/."""
    _install(session, "[test]")
    _azurite(session)
    session.run("pytest", "-m", "not slow", *session.posargs)
    session.run("ruff", "check", "src", "tests", "benchmarks", "examples", "noxfile.py")
    session.run("ruff", "format", "--check", "src", "tests", "benchmarks", "examples", "noxfile.py")
    session.run("mypy")


@nox.session
def stress(session: nox.Session) -> None:
    """The long runs kept out of CI (the `slow` marker): 1,000 random SIGKILLs of a saving
    process, the full fault matrices, 1,000,000 fuzz cases and 100,000 sharded steps."""
    _install(session, "[test]")
    session.run("pytest", "-m", "slow", *session.posargs)


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: an async training run that checkpoints, and loads the result back."""
    _install(session)
    session.run("python", "-m", "aiosnap.demo", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """The benchmark suite (pass e.g. `-- --size 64MiB` for a quick run)."""
    _install(session, "[bench,integrations]")
    session.run("python", "benchmarks/bench.py", *session.posargs)
    if "--help" not in session.posargs:
        quick = ["--size", "64MiB", "--reps", "1"] if "--quick" in session.posargs else []
        publish = ["--publish"] if "--publish" in session.posargs else []
        session.run("python", "benchmarks/bench_ranks.py", *quick, *publish)
        session.run("python", "benchmarks/bench_sharded.py", *quick, *publish)
        session.run("python", "benchmarks/bench_integrations.py", *quick, *publish)
        session.run("python", "benchmarks/bench_ranks_ppe_lightning.py", *quick)
        session.run("python", "benchmarks/bench_ranks_hf_accelerate.py", *quick)
        session.run("python", "benchmarks/bench_incremental.py", *quick, *publish)
        session.run("python", "benchmarks/bench_scale.py", *(["--quick"] if quick else []))
        session.run(
            "python", "benchmarks/bench_nodes.py", *(["--size", "64MiB", "--reps", "1"] if quick else [])
        )
        session.run("python", "benchmarks/bench_peers.py")


@nox.session(venv_backend="none")
def gpu(session: nox.Session) -> None:
    """The CUDA path on a machine with a GPU, in the environment nox runs from, which must
    have a CUDA build of torch and the test extra installed (the CPU wheel constraints.txt
    pins has no CUDA, and such machines may have no network): the tests marked cuda, the
    host-sync and pinning checks, and the GPU benchmark (benchmarks/gpu_check.py; 3.3
    minutes at 3 GiB on one H200, whose image lacked only crc32c and pytest-asyncio: carry
    their wheels). `-- --publish` puts its table into docs/benchmarks.md; `-- --dry-run`
    runs every part on the CPU; the whole pytest log is kept in benchmarks/results/."""
    session.run("python", "benchmarks/gpu_check.py", *session.posargs, external=True)


@nox.session
def docs(session: nox.Session) -> None:
    """The documentation site (mkdocs-material, API reference from the docstrings), built with
    --strict: a broken link or reference fails the build. Opens at .nox/docs-site/index.html
    (`-- serve` instead serves it on 127.0.0.1:8000 and rebuilds on changes)."""
    _install(session, "[docs]")
    env = {"NO_MKDOCS_2_WARNING": "1"}  # mkdocs-material's banner about its successor
    if session.posargs[:1] == ["serve"]:
        session.run("mkdocs", "serve", "--strict", "--dev-addr", "127.0.0.1:8000", env=env)
        return
    session.run("mkdocs", "build", "--strict", "--site-dir", ".nox/docs-site", *session.posargs, env=env)
