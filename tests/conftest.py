"""Test set-up: eight fake CPU devices for the multi-device tests, before JAX starts."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import logging  # noqa: E402

import pytest  # noqa: E402

S3_BUCKET = "gmjax-test"


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
