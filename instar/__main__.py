from instar.cli.main import main

main()
