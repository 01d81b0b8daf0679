from yoke.cli.main import main

main()
