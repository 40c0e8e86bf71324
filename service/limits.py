"""Every bound on what one request may ask for, declared once: the API's request models
(and so the OpenAPI schema) and the engine's SamplingParams both read them. Each bounds
work a request makes the server do per step or per token."""

MAX_N = 16  # sequences per request (n, best_of)
MAX_LOGPROBS = 20  # top alternatives per token (OpenAI's top_logprobs cap)
MAX_STOP = 16  # stop strings, each matched against the text of every new token
MAX_STOP_CHARS = 512  # characters in one stop string
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 300  # entries (OpenAI's cap)
MAX_PROMPTS = 128  # prompts in one completions request
MAX_MESSAGES = 1024  # messages in one chat request
MAX_TEMPLATE_KWARGS = 32  # chat_template_kwargs entries
MAX_TOOLS = 128  # tools in one chat request (their schemas: MAX_CONSTRAINT_CHARS in all)
MAX_CACHE_SALT_CHARS = 256
PRIORITY_RANGE = (-(2**31), 2**31 - 1)  # a request's priority (lower goes first)
# a LoRA adapter's name (in /v1/models, metric labels, every request that names it) and
# the path a run-time load reads
MAX_ADAPTER_NAME_CHARS = 128
MAX_ADAPTER_PATH_CHARS = 4096
ADAPTER_NAME = r"^[A-Za-z0-9._:-]+$"  # a word: no spaces, commas or quotes in a label
MAX_CHOICES = 256  # strings in guided_choice / structured_outputs.choice
MAX_CONSTRAINT_CHARS = 100_000  # a JSON Schema, regex or grammar, as text: compiled per request
# entries of prompt-token logprobs in one response (prompt tokens x (alternatives + 1),
# over every prompt and choice, echo's and prompt_logprobs' each): about 50 bytes of
# JSON an entry, so a response stays within tens of MB
MAX_PROMPT_LOGPROB_ENTRIES = 500_000
