"""Only storage protocols whose exclusive create is atomic can hold a run."""

import numpy as np
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


@pytest.mark.parametrize("url, meant", [("gs:/bucket/run", "gs://bucket/run"),
                                        ("s3:/bucket", "s3://bucket"),
                                        ("memory:/x", "memory://x")])
def test_a_url_with_one_slash_is_named_not_made_a_local_folder(tmp_path, monkeypatch, url,
                                                               meant):
  # "s3:/bucket" made a local run under ./s3:/bucket; "gs:/bucket" half of one, then a
  # raw KeyError from Orbax.
  monkeypatch.chdir(tmp_path)
  with pytest.raises(ValueError, match=f"url='{url}' is not a URL: did you mean {meant}"):
    mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2))
  with pytest.raises(ValueError, match=f"did you mean {meant}"):
    mail.open(url)
  with pytest.raises(ValueError, match=f"state_dir='{url}' is not a URL: did you mean"):
    mail.create("memory://one-slash", ms.params0(), gmjax.DiLoCo(sync_every=2)).join(
        "w", state_dir=url)
  assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("url", ["", " ", "run\0"])
def test_an_empty_url_is_refused(tmp_path, monkeypatch, url):
  # "" made a run in the working directory, beside whatever was there.
  monkeypatch.chdir(tmp_path)
  with pytest.raises(ValueError, match="names no run"):
    mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2))
  assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("value", [float("nan"), 0, -1, float("inf"), "30", True, None])
def test_retry_seconds_must_be_a_positive_finite_number(tmp_path, value):
  mail.create(str(tmp_path / "run"), ms.params0(), gmjax.DiLoCo(sync_every=2))
  error = TypeError if isinstance(value, str) else ValueError  # as join's timeouts
  with pytest.raises(error, match=r"retry_seconds must be a positive, finite number of"
                     r" seconds, got .*; pass"):
    mail.open(str(tmp_path / "run"), retry_seconds=value)
  mail.open(str(tmp_path / "run"), retry_seconds=np.float32(2.5))  # numpy numbers too


def test_storage_options_must_be_a_dict_for_a_url(tmp_path):
  # "abc" failed inside fsspec ("dictionary update sequence element #0 has length 1"),
  # and options given for a local folder were dropped without a word.
  for bad in ("abc", []):
    with pytest.raises(TypeError, match=r"storage_options must be None or a dict"):
      mail.create("memory://options-run", ms.params0(), gmjax.DiLoCo(sync_every=2),
                  storage_options=bad)
  with pytest.raises(ValueError, match=r"is a local folder, which takes no storage_options"
                                       r" \(got \['token'\]\)"):
    mail.create(str(tmp_path / "run"), ms.params0(), gmjax.DiLoCo(sync_every=2),
                storage_options={"token": "x"})
  assert not (tmp_path / "run").exists()
  mail.create(str(tmp_path / "run"), ms.params0(), gmjax.DiLoCo(sync_every=2),
              storage_options={})
  mail.open(str(tmp_path / "run"), storage_options=None)
