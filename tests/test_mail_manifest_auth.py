"""A keyed run's manifest is signed: an edited manifest is refused at open, join, create."""

import json

import pytest

import gmjax
from gmjax import mail

import mail_support as ms

KEY = "manifest-secret"


def _scale_learning_rate(value):
  """Multiplies every ``*learning_rate*`` number in the algorithm's JSON by 100."""
  if isinstance(value, dict):
    return {k: (v * 100 if "learning_rate" in k and isinstance(v, (int, float))
                else _scale_learning_rate(v)) for k, v in value.items()}
  if isinstance(value, list):
    return [_scale_learning_rate(v) for v in value]
  return value


EDITS = {
    "outer_learning_rate": lambda m: m.update(algorithm=_scale_learning_rate(m["algorithm"])),
    "sync_every": lambda m: m["algorithm"].update(sync_every=m["algorithm"]["sync_every"] * 2),
    "delta_precision": lambda m: m["algorithm"].update(delta_precision="I4"),
    "plan": lambda m: m.update(plan=[m["plan"][1], m["plan"][0]]),
    "schema": lambda m: m["schema"].reverse(),
    "created_at": lambda m: m.update(created_at="2000-01-01T00:00:00.000+00:00"),
    "signature removed": lambda m: m.pop("signature"),
}


def _edit(url, edit):
  path = f"{url}/manifest.json"
  with open(path, encoding="utf-8") as f:
    manifest = json.load(f)
  before = json.dumps(manifest, sort_keys=True)
  EDITS[edit](manifest)
  assert json.dumps(manifest, sort_keys=True) != before, edit
  with open(path, "w", encoding="utf-8") as f:
    json.dump(manifest, f)


def _config():
  return gmjax.DiLoCo(sync_every=4, fragments=2, delta_precision="F8_E4M3")


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_edited_manifest_is_refused(tmp_path, edit):
  url = str(tmp_path / "run")
  run = mail.create(url, ms.params0(), _config(), key=KEY)
  mail.open(url, key=KEY)  # intact: opens
  _edit(url, edit)
  with pytest.raises(mail.AuthenticationError, match="manifest"):
    mail.open(url, key=KEY)
  with pytest.raises(mail.AuthenticationError, match="manifest"):
    run.join("w0")  # a run opened before the edit checks again
  with pytest.raises(mail.AuthenticationError, match="manifest"):
    mail.create(url, ms.params0(), _config(), key=KEY)


def test_unkeyed_run_opens_as_before(tmp_path):
  url = str(tmp_path / "run")
  mail.create(url, ms.params0(), _config())
  with open(f"{url}/manifest.json", encoding="utf-8") as f:
    assert "signature" not in json.load(f)
  run = mail.open(url)
  learner = run.join("w0")
  learner.close(learner.pull(ms.params0()))
  with pytest.raises(mail.AuthenticationError):
    mail.open(url, key=KEY)


def test_signed_manifest_verifies_with_the_right_key_only(tmp_path):
  url = str(tmp_path / "run")
  mail.create(url, ms.params0(), _config(), key=KEY)
  assert mail.open(url, key=KEY).manifest.config == _config()
  with pytest.raises(mail.AuthenticationError):
    mail.open(url, key="another key")
  with pytest.raises(mail.AuthenticationError):
    mail.open(url)


def test_forged_records_below_and_above_the_kept_versions_do_not_refuse_the_run(tmp_path):
  # Whoever can write the run's storage, without the key, plants unsigned records at
  # versions retention pruned and above the newest: the run's own manifest still opens.
  from gmjax.mail import layout, states  # pylint: disable=g-import-not-at-top

  url = str(tmp_path / "run")
  run = mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=1, quorum_size=1), key="k",
                    keep_versions=2)
  ms.train(run, "w", 0, 70)
  kept = states.committed_versions(run.store, 0)
  assert kept == [69, 70]
  template = json.loads(run.store.get(layout.commit(0, kept[-1])))
  for version in [*range(64), *range(1000, 1064)]:
    forged = {**template, "version": version, "round": version - 1, "signature": "0" * 64}
    run.store.put(layout.commit(0, version), json.dumps(forged).encode())
  assert mail.open(url, key="k").newest_versions() == {0: 70}
