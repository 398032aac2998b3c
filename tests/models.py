"""The reference models live in the package (shardc.tools.models): the demo and the CLI use
them too."""
from shardc.tools.models import (  # noqa: F401
                           GPT,
                           MLPChain,
                           falcon,
                           gpt2,
                           gpt_bigcode,
                           gpt_neox,
                           litgpt_llama,  # (re-exported)
                           llama,
                           opt,
                           phi3,
)
