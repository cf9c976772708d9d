"""The paper's Table 3 ablations (Vaswani et al., 2017, section 6.2) at Multi30k scale.

    ./launch.sh sweep experiments/table3.py --parallel 2     -> runs/sweeps/table3/results.md

The base is configs/multi30k.py:variant=small, assumed to be the paper's base model at half
width: d_model 256, d_ff 1024 (every number of the paper that follows from d_model = 512 is
multiplied by D_MODEL / 512 = 1/2; change D_MODEL if the small variant changes). Point 0 is
the unchanged base; then the rows (ROWS), paper -> here:

    A  heads, keeping h * d_k = d_model: (h, d_k, d_v) = (1, 512, 512), (4, 128, 128),
       (16, 32, 32), (32, 16, 16) -> model.num_heads 1, 4, 16, 32 (d_k = d_v = 256 / h:
       256, 64, 16, 8; the config's head_dim None means d_model // num_heads)
    B  key size d_k 16, 32 with d_v unchanged (h = 8, d_v = 64) -> model.head_dim 16, 32 and
       model.value_head_dim = the base's d_v, 256 / 4 = 64, with the base's heads: only the
       query/key width changes, as in the paper (model.head_dim alone would shrink d_v too).
       The base's heads are 64 wide like the paper's, so d_k keeps the paper's values and
       their ratio to d_v (1/4, 1/2); widths are not halved here.
    C  size: N 2, 4, 8 (depth does not scale: model.num_encoder_layers = num_decoder_layers);
       d_model 256, 1024 (d_ff unchanged, as in the paper) -> 128, 512;
       d_ff 1024, 4096 -> 512, 2048
    D  regularisation: P_drop 0.0, 0.2 (model.dropout_rate); label smoothing eps_ls 0.0, 0.2
       (train.label_smoothing); not scaled
    E  learned positional embeddings instead of sinusoids (model.positional = 'learned')

Point names (and workdirs) come from the overrides, e.g. 'model.num_heads=16'.
"""

CONFIG = "configs/multi30k.py:variant=small"
NAME = "table3"
D_MODEL = 256  # the base config's model.d_model; the paper's numbers assume 512
NUM_HEADS = 4  # the base config's model.num_heads: its d_v is D_MODEL // NUM_HEADS


def rows(d_model: int = D_MODEL, num_heads: int = NUM_HEADS) -> dict[str, list[dict]]:
    """The rows' points for a base of width d_model with num_heads heads (d_v = d_model / h):
    widths the paper gives for d_model = 512 scale by d_model / 512; row B keeps the paper's
    ratios d_k / d_v = 1/4, 1/2 (16 and 32 at d_v = 64)."""

    def scale(paper_value: int) -> int:
        return paper_value * d_model // 512

    def layers(n: int) -> dict:
        return {"model.num_encoder_layers": n, "model.num_decoder_layers": n}

    d_v = d_model // num_heads
    return {
        "A": [{"model.num_heads": h} for h in (1, 4, 16, 32)],
        "B": [{"model.head_dim": d_v * r // 4, "model.value_head_dim": d_v} for r in (1, 2)],
        "C": [layers(n) for n in (2, 4, 8)]
        + [{"model.d_model": scale(d)} for d in (256, 1024)]
        + [{"model.d_ff": scale(f)} for f in (1024, 4096)],
        "D": [{"model.dropout_rate": p} for p in (0.0, 0.2)]
        + [{"train.label_smoothing": e} for e in (0.0, 0.2)],
        "E": [{"model.positional": "learned"}],
    }


ROWS: dict[str, list[dict]] = rows()


def sweep() -> list[dict]:
    return [{}] + [point for row in ROWS.values() for point in row]
