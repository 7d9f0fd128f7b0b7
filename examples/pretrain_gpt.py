"""A GPT pretraining script written the way Megatron-LM's own ``pretrain_gpt.py`` is: ``megatron.training.pretrain()``
with the model from megatron.training's GPT builder and Megatron's ``GPTDataset`` over an indexed dataset.

It knows nothing of fp4_dist; run it through the launcher to train with NVFP4 weights:

    torchrun --nproc-per-node 2 -m fp4_dist.megatron.run examples/pretrain_gpt.py \\
        --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 \\
        --micro-batch-size 2 --global-batch-size 8 --train-iters 20 --lr 2e-3 --bf16 --use-distributed-optimizer \\
        --tokenizer-type NullTokenizer --vocab-size 256 --data-path DATA_PREFIX --split 80,10,10 --log-interval 5 \\
        --eval-iters 2 --fp4-param-gather

(`python -m examples.megatron_preprocess --input TEXT --output-prefix DATA_PREFIX` writes the indexed dataset.)
Megatron-LM's ``pretrain_gpt.py`` takes the same command; this one leaves out its options (SFT, FIM, MTP, context
parallel, packed sequences), so every rank reads its own batch and tensor-parallel ranks need no broadcast.
"""

from __future__ import annotations

from functools import partial

import torch

from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.utils import get_blend_from_list
from megatron.core.enums import ModelType
from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
from megatron.training import get_args, pretrain, print_rank_0
from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
from megatron.training.arguments import parse_and_validate_args


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Sum of the token losses, the token count, and the pair Megatron averages over the data-parallel ranks."""
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    tokens = mask.sum().to(torch.int)
    return loss, tokens, {"lm loss": torch.cat([loss.detach().view(1), tokens.view(1)])}


def forward_step(data_iterator, model):
    batch = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in next(data_iterator).items()}
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"])


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    # vp_stage: Megatron asks for it with virtual pipeline stages; every stage reads the same datasets here.
    args = get_args()
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=get_blend_from_list(args.data_path),
        split=args.split,
        tokenizer=build_tokenizer(args),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=True,
        path_to_cache=args.data_cache_path,
    )
    print_rank_0("> building train, validation, and test datasets for GPT ...")
    return BlendedMegatronDatasetBuilder(GPTDataset, train_val_test_num_samples, lambda: True, config).build()


if __name__ == "__main__":
    train_valid_test_datasets_provider.is_distributed = True  # every rank builds (and reads) its own datasets
    args = parse_and_validate_args(args_defaults={"tokenizer_type": "NullTokenizer"})
    pretrain(pretrain_cfg_container_from_args(args, gpt_config_from_args(args)), train_valid_test_datasets_provider,
             ModelType.encoder_or_decoder, forward_step)
