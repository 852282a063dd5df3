"""Grammar-constrained decoding: ``params`` (what a request asks), ``api`` (the HTTP surface mapped onto it),
``backends`` (xgrammar, llguidance), ``manager`` (the engine's owner of grammars). Submodules are imported directly: the
package itself stays torch-free for the CLI."""
