"""Only storage protocols whose exclusive create is atomic can hold a run."""

import pytest

import gmjax
from gmjax import mail
from gmjax.mail import store as store_lib

import mail_support as ms

# fsspec knows each of these, but its create there is exists() then a write.
UNSUPPORTED = ["simplecache::memory://run", "zip://inner::memory://a.zip", "ftp://127.0.0.1/run",
               "http://127.0.0.1:9/run", "dir::memory://run", "reference://run"]


@pytest.mark.parametrize("url", UNSUPPORTED)
def test_open_store_refuses_protocols_without_atomic_create(url):
  protocol = url.split("://", 1)[0]
  with pytest.raises(mail.UnsupportedStorage, match="not supported") as error:
    store_lib.open_store(url)
  message = str(error.value)
  assert repr(protocol) in message and "s3://" in message and "gs://" in message
  assert isinstance(error.value, ValueError)


def test_create_and_open_refuse_them():
  with pytest.raises(mail.UnsupportedStorage, match="'simplecache::memory'"):
    mail.create("simplecache::memory://run", ms.params0(), gmjax.DiLoCo(sync_every=2))
  with pytest.raises(mail.UnsupportedStorage, match="'ftp'"):
    mail.open("ftp://127.0.0.1/run")


@pytest.mark.parametrize("url", ["memory://protocols-ok", "file:///tmp/gmjax-protocols-ok"])
def test_supported_protocols_open(url):
  assert store_lib.open_store(url).url == url
