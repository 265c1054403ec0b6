"""gmjax: low-communication distributed training (DiLoCo, Streaming DiLoCo) for JAX."""

from gmjax.core.codec import decode as decode
from gmjax.core.codec import dequantize as dequantize
from gmjax.core.codec import encode as encode
from gmjax.core.codec import layout as layout
from gmjax.core.codec import quantize as quantize
from gmjax.core.diloco import DiLoCo as DiLoCo
from gmjax.core.records import Aggregator as Aggregator
from gmjax.core.records import Algorithm as Algorithm
from gmjax.core.records import Contribution as Contribution
from gmjax.core.records import FragmentState as FragmentState
from gmjax.core.records import Participant as Participant
from gmjax.core.records import Precision as Precision
from gmjax.core.records import RoundResult as RoundResult
from gmjax.core.schedule import Estimates as Estimates
from gmjax.core.schedule import RoundSchedule as RoundSchedule
from gmjax.core.schema import ParameterSpec as ParameterSpec
from gmjax.core.schema import Schema as Schema
from gmjax.core.stats import cosine as cosine
from gmjax import mail as mail
from gmjax.transform.diloco import diloco as diloco
from gmjax.transform.finish import finish as finish
from gmjax.transform.state import DiLoCoState as DiLoCoState
from gmjax.transform.state import DiLoCoStatistics as DiLoCoStatistics

__version__ = "0.1.0"

__all__ = (
    "Aggregator",
    "Algorithm",
    "Contribution",
    "DiLoCo",
    "DiLoCoState",
    "DiLoCoStatistics",
    "Estimates",
    "FragmentState",
    "ParameterSpec",
    "Participant",
    "Precision",
    "RoundResult",
    "RoundSchedule",
    "Schema",
    "cosine",
    "decode",
    "dequantize",
    "diloco",
    "encode",
    "finish",
    "layout",
    "mail",
    "quantize",
)
