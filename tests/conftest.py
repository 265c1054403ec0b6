"""Test set-up: eight fake CPU devices for the multi-device tests, before JAX starts.

The tests compile hundreds of small programs and run each for a few steps, and LLVM's
optimization of the generated kernels was a fifth of the suite's time on 2 cores. So
they compile with ``--xla_backend_optimization_level=0``: XLA's own passes still run, so
the compiled HLO, its buffers, scratch and collectives, which the tests inspect, are the
same, and so are the results the tests compare bit for bit (the whole suite passes at
either level). Benchmarks and users compile at the default level. Set ``XLA_FLAGS`` to
choose otherwise.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8"
                      " --xla_backend_optimization_level=0")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import logging  # noqa: E402

import jax  # noqa: E402,F401  (reads its environment now: see the cache below)
import pytest  # noqa: E402

S3_BUCKET = "gmjax-test"


@pytest.fixture(scope="session", autouse=True)
def _compiled_programs_shared_by_child_processes(tmp_path_factory):
  """One JAX compilation cache for the processes the tests start (CLI jobs, learners,
  notebook kernels), shared by the session's workers: a job's learners and the jobs
  that resume a run load the programs compiled before instead of compiling them again.

  Set after JAX has read its environment (imported above), so the tests' own process
  compiles every program it inspects. The folder lies under the session's base
  temporary folder, which pytest removes with its old runs.
  """
  base = tmp_path_factory.getbasetemp()
  root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
  with pytest.MonkeyPatch.context() as env:
    env.setenv("JAX_COMPILATION_CACHE_DIR", str(root / "jax-compilation-cache"))
    env.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")  # small test programs
    yield


@pytest.fixture(scope="session")
def s3_options():
  """s3fs storage options for a moto S3 server on 127.0.0.1, with ``S3_BUCKET`` made.

  One server for the whole session: moto keeps its buckets in the process, across
  servers, so every test that needs S3 shares it. Dummy credentials keep botocore from
  looking for real ones. Skips the test where ``moto[server]`` or ``s3fs`` is missing.
  """
  moto_server = pytest.importorskip("moto.server")
  s3fs = pytest.importorskip("s3fs")
  logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
  with pytest.MonkeyPatch.context() as env:
    for name, value in (("AWS_ACCESS_KEY_ID", "x"), ("AWS_SECRET_ACCESS_KEY", "x"),
                        ("AWS_DEFAULT_REGION", "us-east-1")):
      env.setenv(name, value)
    env.delenv("AWS_PROFILE", raising=False)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
      host, port = server.get_host_and_port()
      options = {"endpoint_url": f"http://{host}:{port}", "key": "x", "secret": "x"}
      s3fs.S3FileSystem(skip_instance_cache=True, **options).mkdir(S3_BUCKET)
      yield options
    finally:
      server.stop()
