from relpos_cli.cli import main

main()
