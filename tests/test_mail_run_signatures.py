"""Signatures cover the run: a signed object copied from another run with the same key
(a commit, a contribution, a heartbeat, the manifest) is rejected, and ``verify`` says so."""

import json
import os
import shutil

import numpy as np
import pytest

import gmjax
from gmjax import mail
from gmjax.mail import contributions
from gmjax.mail import layout
from gmjax.mail import signing
from gmjax.mail import states

import mail_support as ms

KEY = "shared-secret"
CONFIG = gmjax.DiLoCo(sync_every=2, quorum_size=1, flush_on_close=False)


@pytest.fixture(scope="module")
def other(tmp_path_factory):
  """A keyed run, one round on: the run objects are copied from."""
  url = str(tmp_path_factory.mktemp("other") / "run")
  ms.train(mail.create(url, ms.params0(), CONFIG, key=KEY), "w", 0, 2)
  return url


def _copy(source, target, relative):
  source, target = os.path.join(source, relative), os.path.join(target, relative)
  os.makedirs(os.path.dirname(target), exist_ok=True)
  (shutil.copytree if os.path.isdir(source) else shutil.copyfile)(source, target)


def test_a_commit_copied_from_another_run_is_not_adopted(other, tmp_path):
  url = str(tmp_path / "run")
  mail.create(url, ms.params0(), CONFIG, key=KEY)
  for entry in os.listdir(os.path.join(other, "fragments/0")):
    if entry.startswith("1"):  # version 1: its record, state, Θ and update
      _copy(other, url, f"fragments/0/{entry}")
  assert mail.open(url, key=KEY).newest_versions() == {0: 0}
  problems = mail.verify(url, key=KEY)
  assert [p for p in problems if p.startswith(layout.commit(0, 1))
          and "another run's" in p], problems


def test_a_heartbeat_copied_from_another_run_is_ignored_and_reported(other, tmp_path):
  url = str(tmp_path / "run")
  run = mail.create(url, ms.params0(), CONFIG, key=KEY)
  _copy(other, url, layout.heartbeat("w"))
  assert [b["learner"] for b in run.status()["bad_heartbeats"]] == ["w"]
  assert [p for p in mail.verify(url, key=KEY) if p.startswith(layout.heartbeat("w"))]


def test_a_manifest_copied_from_another_run_is_refused(other, tmp_path):
  url = str(tmp_path / "run")
  mail.create(url, ms.params0(), CONFIG, key=KEY)
  _copy(other, url, layout.MANIFEST)
  with pytest.raises(mail.AuthenticationError, match="another run"):
    mail.open(url, key=KEY)
  assert mail.verify(url, key=KEY)[0].startswith(layout.MANIFEST)


@pytest.mark.timeout(120)
def test_a_manifest_copied_into_a_run_that_pruned_version_0_is_refused(other, tmp_path):
  # Only version 0's records were checked: once retention pruned them, the copied
  # manifest opened, and every join then failed with "every commit is damaged; create
  # the run again".
  url = str(tmp_path / "run")
  run = mail.create(url, ms.params0(), CONFIG, key=KEY, keep_versions=2)
  ms.train(run, "w", 0, 8)
  assert 0 not in states.committed_versions(run.store, 0)
  oldest = min(states.committed_versions(run.store, 0))
  # A record forged below the oldest kept version does not make the run refuse its own
  # manifest: the next version is signed for it.
  forged = json.loads(run.store.get(layout.commit_slot(0, oldest, 0)))
  run.store.put(layout.commit_slot(0, oldest - 1, 0),
                json.dumps({**forged, "version": oldest - 1, "signature": "0" * 64}).encode())
  assert mail.open(url, key=KEY).manifest.config == CONFIG
  _copy(other, url, layout.MANIFEST)
  with pytest.raises(mail.AuthenticationError, match=r"version [1-9] of fragment 0 is not signed.*another run"):
    mail.open(url, key=KEY)


def test_a_contribution_signed_for_another_run_is_rejected(tmp_path):
  here = mail.create(str(tmp_path / "here"), ms.params0(), CONFIG, key=KEY)
  there = mail.create(str(tmp_path / "there"), ms.params0(), CONFIG, key=KEY)
  assert here.signing_key != there.signing_key  # one key, two runs: two signing keys
  schema = here.manifest.schema.subset(here.plan[0])
  entries = {n: np.zeros(schema[n].shape, np.float32) for n in here.plan[0]}
  fields = dict(learner="w", round_=0, fragment=0, base_version=0, local_step=2, steps=2,
                tokens=2, step_seconds=0.1, final=False, precision=None)
  check = dict(file_name="w.safetensors", round_=0, fragment=0, base_version=0,
               schema=schema, wire=here.config.delta_wire, known={"w"},
               key=here.signing_key, max_steps=2)
  contributions.check(contributions.dumps(entries, key=here.signing_key, **fields), **check)
  with pytest.raises(mail.ContributionRejected, match="signature"):
    contributions.check(contributions.dumps(entries, key=there.signing_key, **fields), **check)


def test_a_run_created_before_signatures_covered_the_run_signs_with_its_key():
  auth = signing.new_auth(b"k")
  assert signing.run_key(b"k", auth) not in (b"k", signing.run_key(b"k", signing.new_auth(b"k")))
  del auth["run_bound"]
  assert signing.run_key(b"k", auth) == b"k"
  assert signing.run_key(None, signing.new_auth(b"k")) is None
  assert json.loads(json.dumps(signing.new_auth(b"k")))["run_bound"] is True
