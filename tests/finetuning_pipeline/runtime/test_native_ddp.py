"""The native runtime's DDP step names a peer lost in the gradients' sum as the replicas' own
collectives do (ReplicaLost: exit 3, resume), and lets every other error through as it is."""

from __future__ import annotations

import pytest
import torch

from finetuning_pipeline.errors import ReplicaLost
from finetuning_pipeline.runtime.native.ddp import summed_backward

pytestmark = pytest.mark.native


class Replicas:
    rank = 1


def failing_with(message: str):
    def loss_sums(batch):
        raise RuntimeError(message)
    return loss_sums


def test_a_backend_error_in_the_summed_backward_is_a_lost_replica():
    model = torch.nn.Linear(2, 2)
    model.dtype = torch.float32
    gone = "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:547] Connection closed by peer [127.0.0.1]:37800"
    with pytest.raises(ReplicaLost, match=r"replica 1: another replica stopped answering in the gradients' sum"):
        summed_backward(model, {}, failing_with(gone), Replicas())
    with pytest.raises(RuntimeError, match="^mat1 and mat2 shapes cannot be multiplied$"):
        summed_backward(model, {}, failing_with("mat1 and mat2 shapes cannot be multiplied"), Replicas())
