"""The reference models live in the package (shardc.tools.models): the demo and the CLI use
them too."""
from shardc.tools.models import (GPT, MLPChain, falcon, gpt2, gpt_bigcode, gpt_neox,  # noqa: F401
                           litgpt_llama, llama, opt, phi3)  # (re-exported)
