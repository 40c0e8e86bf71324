"""The text of a request's output, made in the front that serves it: incremental
detokenization and stop strings over the token ids the engine core sends."""
