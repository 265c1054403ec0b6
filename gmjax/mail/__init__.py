"""``gmjax.mail``: learners that train apart and meet through storage.

A run is a prefix on object storage (a local directory by default, ``memory://``, or
``gs://`` through gcsfs). Learners publish their deltas there, one of them closes each
round (aggregate, outer step, durable commit) and the others follow, taking over when the
closer dies.
"""

from gmjax.mail.errors import AuthenticationError as AuthenticationError
from gmjax.mail.errors import ContributionRejected as ContributionRejected
from gmjax.mail.errors import CorruptRecord as CorruptRecord
from gmjax.mail.errors import LearnerClosed as LearnerClosed
from gmjax.mail.errors import NameTaken as NameTaken
from gmjax.mail.errors import RoundTimeout as RoundTimeout
from gmjax.mail.errors import RunExists as RunExists
from gmjax.mail.errors import RunNotFound as RunNotFound
from gmjax.mail.errors import StateDirMismatch as StateDirMismatch
from gmjax.mail.errors import StorageNotInstalled as StorageNotInstalled
from gmjax.mail.errors import StorageUnavailable as StorageUnavailable
from gmjax.mail.errors import UnsupportedStorage as UnsupportedStorage
from gmjax.mail.heartbeats import Heartbeat as Heartbeat
from gmjax.mail.learner import Learner as Learner
from gmjax.mail.learner_state import Restored as Restored
from gmjax.mail.records import RoundRecord as RoundRecord
from gmjax.mail.run import Run as Run
from gmjax.mail.run import create as create
from gmjax.mail.run import open as open  # pylint: disable=redefined-builtin
from gmjax.mail.status import format_status as format_status
from gmjax.mail.store import Store as Store
from gmjax.mail.store import open_store as open_store
from gmjax.mail.verify import verify as verify

__all__ = (
    "AuthenticationError",
    "ContributionRejected",
    "CorruptRecord",
    "Heartbeat",
    "Learner",
    "LearnerClosed",
    "NameTaken",
    "Restored",
    "RoundRecord",
    "RoundTimeout",
    "Run",
    "RunExists",
    "RunNotFound",
    "StateDirMismatch",
    "StorageNotInstalled",
    "StorageUnavailable",
    "Store",
    "UnsupportedStorage",
    "create",
    "format_status",
    "open",
    "open_store",
    "verify",
)
