"""The control block on the Python side, one job per module:

- ``layout``: the binary layout Python writes (field types; offsets, sizes and every number
  from ``_C``, i.e. csrc/include/xmix/control.h) and the buffers' capacities
- ``arena``: room in the shared tables (parameter columns, channels, token sets, spans,
  vector state, capture buffer), first fit, with rollback of a refused deploy
- ``params``: an app's parameter columns and a request's named values resolved to them
- ``link``: after lowering, an app placed (``InstalledApp``, per op by its position in the
  lowered op list) and a set of apps turned into the op list (OpDesc records, condition code,
  site tables, token sets, spans)
- ``custom``: user kernels loaded at deploy, and their launches on a GPU (``CustomOps``)
- ``memory``: ``BlockMemory``, the buffers, header and host -> device sync, and the live
  tables (deployed apps, site op lists, app bitmasks): the one object the parts share
- ``deploy``: ``Deployer``, install (prepare, commit, abort), patch and remove, each a
  transaction swapped in between two steps
- ``slots``: request slots and what each request asked for and has reported (``SlotState``);
  admitting, preempting and releasing requests (``Slots``)
- ``step``: ``Step``, one forward on the host: step maps, prologue, the empty step after
- ``stage``: a step's host data to the device on staged (GPU) engines
- ``site_state``: what site programs report (``SiteReports``): failures, seconds,
  non-finite writes
- ``drain``: a step's reads to per-request results (``Drain``), and their staged read-back
- ``block``: ``ControlBlock``, the composition of the parts above
"""

from xmix.lang.lowering import DeployError, RequestError
from xmix.runtime.control.block import ControlBlock
from xmix.runtime.control.drain import PendingReads
from xmix.runtime.control.layout import (
    CMP_CODES,
    CTRL_LAYOUT,
    FLAG_BITS,
    MODES,
    OP_LAYOUT,
    OP_SIZE,
    Capacity,
    K,
)
from xmix.runtime.control.link import InstalledApp, LinkedOp
from xmix.runtime.control.params import ParamCol, param_columns, resolve_params
from xmix.runtime.control.slots import SlotState

__all__ = [
    "CMP_CODES",
    "CTRL_LAYOUT",
    "Capacity",
    "ControlBlock",
    "DeployError",
    "FLAG_BITS",
    "InstalledApp",
    "K",
    "LinkedOp",
    "MODES",
    "OP_LAYOUT",
    "OP_SIZE",
    "ParamCol",
    "PendingReads",
    "RequestError",
    "SlotState",
    "param_columns",
    "resolve_params",
]
