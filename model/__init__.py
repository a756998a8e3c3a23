"""The LLaMA-style decoder (see docs/architecture.md): typed config, layers, attention dispatch."""

from model.attention import dense_attention, dense_kernel, dense_line
from model.config import ATTENTIONS, KERNELS, REMAT_POLICIES, ModelConfig
from model.decoder import Decoder
