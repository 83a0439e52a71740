"""The native runtime's DDP step names a peer lost in the gradients' sum as the replicas' own
collectives do (ReplicaLost: exit 3, resume), and lets every other error through as it is."""

from __future__ import annotations

import pytest
import torch

from finetuning_pipeline.errors import ReplicaLost
from finetuning_pipeline.runtime.native.ddp import lost_replica_named

pytestmark = pytest.mark.native


class Replicas:
    rank = 1


def test_a_backend_error_in_the_summed_backward_is_a_lost_replica():
    gone = "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:547] Connection closed by peer [127.0.0.1]:37800"
    with pytest.raises(ReplicaLost, match=r"replica 1: another replica stopped answering in the gradients' sum"):
        with lost_replica_named(Replicas()):
            raise RuntimeError(gone)
    with pytest.raises(RuntimeError, match=r"^mat1 and mat2 shapes cannot be multiplied \(2x3 and 2x3\)$"):
        with lost_replica_named(Replicas()):
            torch.ones(2, 3) @ torch.ones(2, 3)
