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


def test_a_backend_error_in_the_summed_backward_is_a_lost_replica_in_one_line():
    """gloo's message runs on for lines of its call sites ("At: .../ddp.py(42): <lambda>"): the
    replica's error is its first line, with the replica's rank."""
    gone = ("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:547] Connection closed by peer [127.0.0.1]:37800\n"
            "Exception raised from recv at /pytorch/torch/csrc/distributed/c10d/ProcessGroupGloo.cpp:1234\n\n"
            "At:\n  finetuning_pipeline/runtime/native/ddp.py(42): <lambda>\n")
    with pytest.raises(ReplicaLost) as lost:
        with lost_replica_named(Replicas()):
            raise RuntimeError(gone)
    assert str(lost.value) == (f"replica 1: another replica stopped answering in the gradients' sum "
                               f"({gone.splitlines()[0]}); the run resumes from its last complete checkpoint with "
                               "--resume auto")
    with pytest.raises(RuntimeError, match=r"^mat1 and mat2 shapes cannot be multiplied \(2x3 and 2x3\)$"):
        with lost_replica_named(Replicas()):
            torch.ones(2, 3) @ torch.ones(2, 3)
