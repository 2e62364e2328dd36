"""The draft cache's state tensor (`vtool build --draft-cache-len`): the contract between the compiled
draft_step (models/draft_chain.py, schedules/cuda/draft_chain.py) and the runtime that fills and
reads it (runtime/engine/draft_chain.py), and the layout of the attention's pieces that the plain kernels
(models/) and their CUDA forms (schedules/) both write. The state's int32 slots:

    POSITION    the position of the round's first fed token
    NUM_FORCED  how many tokens the round feeds before drafting on its own (1..MAX_FORCED)
    STEP        the next step's index j (the runtime writes 0; each step adds 1)
    FORCED..    the fed tokens
    OUT + j     the greedy token step j drew
"""
POSITION, NUM_FORCED, STEP, FORCED = 0, 1, 2, 3
MAX_FORCED = 2  # a round feeds at most the target's last token and the draft the cache lacks
OUT = 8
MAX_STEPS = 24  # steps a round may run (its drafts plus MAX_FORCED - 1)
# Tokens a lone-decode round gives (runtime/engine/lone_decode.py; at most MAX_STEPS - MAX_FORCED + 1):
# enough that the host's turn between rounds (state write, token read, outputs) is small beside the
# steps, few enough that a stream's tokens arrive in small bursts and a request ending mid-round
# wastes little.
LONE_DECODE_STEPS = 8
STATE_LEN = OUT + MAX_STEPS

# The draft attention's pieces: each query's positions are cut into at most SPLITS, and every piece
# keeps a row [max score, sum of exp(score - max), the weighted sum of values over head_dim] (float32).
SPLITS = 32
PART_MAX, PART_SUM = 0, 1
PART_ACC = 2

# chain_verify's state (a target model's own cache: it scores a round's drafts in one captured call).
# Every call computes MAX_VERIFY rows: the round's last accepted token and its drafts, then padding.
V_POSITION = 0  # the position of row 0
V_TOKENS = 8  # the rows' tokens
MAX_VERIFY = 8  # rows a call scores (so at most MAX_VERIFY - 1 drafts)
V_OUT = V_TOKENS + MAX_VERIFY  # the greedy token after each row
VERIFY_STATE_LEN = V_OUT + MAX_VERIFY
