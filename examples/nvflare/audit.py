"""Server side: record every update that arrives (a task-result filter on the server, direction IN)."""

from __future__ import annotations

import json
import threading

import numpy as np
from nvflare.apis.dxo import DataKind, MetaKey, from_shareable
from nvflare.apis.filter import Filter
from nvflare.apis.fl_constant import ReservedKey, ReturnCode
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable
from nvflare.app_common.app_constant import AppConstants


class UpdateAudit(Filter):
    """Appends one JSON line per arriving train result to ``path``: the site, the round, the DXO kind, the
    fraction of exactly-zero delta entries (GradPrune), the fraction of non-zero entries that are integer
    multiples of ``lr`` (SignCompression with plain SGD: each local step moves a weight by +-lr), the
    guardfl meta the site's filter wrote, and the accuracy of the global model the site reported."""

    def __init__(self, path: str = "audit.jsonl", lr: float = 0.02) -> None:
        super().__init__()
        self.path = path
        self.lr = lr
        self._lock = threading.Lock()

    def process(self, shareable: Shareable, fl_ctx: FLContext) -> Shareable:
        record = {"site": shareable.get_peer_prop(ReservedKey.IDENTITY_NAME, "?"),
                  "round": shareable.get_header(AppConstants.CURRENT_ROUND),
                  "return_code": shareable.get_return_code()}
        if record["return_code"] == ReturnCode.OK:
            dxo = from_shareable(shareable)
            # the name the site's script put in the meta comes first: the simulator's peer context named one site
            # for all four results when the sites ran in one process (a CI run's server log: "got result from
            # client site-1" under peer=site-2)
            record["site"] = dxo.get_meta_prop("site") or record["site"]
            record["kind"] = str(getattr(dxo.data_kind, "value", dxo.data_kind))
            if dxo.data_kind == DataKind.WEIGHT_DIFF:
                flat = np.concatenate([np.asarray(v, dtype=np.float64).ravel() for v in dxo.data.values()])
                nonzero = flat[flat != 0]
                steps = nonzero / self.lr
                record["zero_fraction"] = float((flat == 0).mean())
                record["lr_multiple_fraction"] = float((np.abs(steps - np.round(steps)) < 1e-3).mean()) if nonzero.size else None
            record["guardfl"] = dxo.get_meta_prop("guardfl")
            record["global_accuracy"] = (dxo.get_meta_prop(MetaKey.INITIAL_METRICS) or {}).get("accuracy")
        with self._lock, open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        return shareable
