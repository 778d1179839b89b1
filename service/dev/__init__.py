"""Not production: the embedded Valkey and Postgres of `progress-service dev` and the tests, and the `dev` command.
Only the command line imports it, lazily, when `dev` runs (an import contract holds it)."""
