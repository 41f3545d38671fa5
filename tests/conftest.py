import torch

# The test models are tiny: one thread is as fast as two, and it keeps timings sane when the
# other core is busy (a second OpenMP thread spin-waits on a loaded core).
torch.set_num_threads(1)
