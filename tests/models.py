"""The reference models live in the package (shardc.models): the demo and the CLI use
them too."""
from shardc.models import GPT, MLPChain, gpt2, llama, opt  # noqa: F401  (re-exported)
