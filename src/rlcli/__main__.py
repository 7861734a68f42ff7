from rlcli.cli.app import main

main()
